//! [`LentSink`]: tensors a caller owns — an inference engine's, or Python's —
//! lent to the sink for the one call that writes them.
//!
//! The sink holds no weights. It knows the version the caller's tensors hold
//! and, per tensor, its dtype, shape and digest (from the anchor applied,
//! moved by each delta), and where its memory was when the sink last wrote
//! it. An update is *staged* without the tensors (the loop's
//! [`Subscriber::stage`](super::step::Subscriber::stage)): a delta version's
//! objects are kept as downloaded and checked against their manifest; an
//! anchor is assembled in memory (a [`MemorySink`]) with the versions after
//! it. Then, with the tensors lent:
//!
//! - [`LentSink::prepare`] verifies a delta against them and decodes every
//!   change, writing nothing (the engine may still serve from them);
//! - [`Subscriber::commit_into`](super::step::Subscriber::commit_into), the
//!   tensors lent for the call,
//!   writes: the prepared changes (one scatter), or a verify-then-write apply,
//!   or the anchor's tensors (all present with their dtype and shape, checked
//!   before any write);
//! - for tensors the caller writes itself (on a GPU), [`LentSink::resolve`]
//!   gathers the old values through the caller, checks them against the
//!   delta's base and returns the writes;
//!   [`Subscriber::commit_written`](super::step::Subscriber::commit_written)
//!   records the new version.
//!
//! An update is bound to the tensors this sink manages: a tensor whose memory
//! is not where the sink last wrote it (another subscriber's tensors, or
//! memory the engine reallocated) is refused before anything is written, and
//! the next update starts from an anchor.
//!
//! Verification is O(changed) ([`crate::codec::apply_in_place_all`]): only
//! elements a delta changes are checked, so a caller's tensors that differ
//! elsewhere keep their difference; [`LentSink::verify`] checks whole
//! tensors at the cost of a pass.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use bytes::Bytes;
use rayon::prelude::*;

use crate::codec::{
    ApplyReport, Changes, Context, Delta, InPlaceOptions, InPlaceReport, Positions, Prepared,
    Target, apply_in_place_all_ctx, inspect, prepare_in_place_all_ctx,
};
use crate::digest::{Digest, tensor_digest_of};
use crate::dtype::{Dtype, parse_dtype, word_bytes};
use crate::error::{Error, Result};
use crate::format::Kind;
use crate::protocol::Manifest;
use crate::tensors::{ExternalBuffer, TensorSet};

use super::sink::{AnchorDest, AnchorObject, Contexts, MemorySink, Produced, Sink, check_version};
use super::step::{CaughtUp, Subscriber};
use super::update::StepOptions;

/// A tensor the caller lends for one call: name, dtype, shape and memory.
pub struct LentTensor {
    /// The tensor's name (as the checkpoint names it).
    pub name: String,
    /// Its dtype.
    pub dtype: Dtype,
    /// Its shape.
    pub shape: Vec<usize>,
    /// Its memory (writable for a commit).
    pub buf: Box<dyn ExternalBuffer>,
}

impl std::fmt::Debug for LentTensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LentTensor")
            .field("name", &self.name)
            .field("dtype", &self.dtype)
            .field("shape", &self.shape)
            .field("memory", &self.memory())
            .finish()
    }
}

impl LentTensor {
    /// Where its memory is: (address, length).
    pub fn memory(&self) -> (usize, usize) {
        let b = self.buf.bytes();
        (b.as_ptr() as usize, b.len())
    }

    fn target(&mut self) -> Result<Target<'_>> {
        let name = &self.name;
        let data = self
            .buf
            .bytes_mut()
            .ok_or_else(|| Error::BadRequest(format!("tensor `{name}` was lent read-only")))?;
        Ok(Target {
            name,
            dtype: self.dtype,
            shape: &self.shape,
            data,
        })
    }
}

/// Refuses tensors whose memory overlaps (two names for one storage, or
/// views of each other): writing one would change the other behind the
/// verification's back.
pub fn check_disjoint(lent: &[LentTensor]) -> Result<()> {
    let mut ranges: Vec<(usize, usize, &str)> = lent
        .iter()
        .map(|l| (l.memory(), l.name.as_str()))
        .filter(|((_, len), _)| *len > 0)
        .map(|((at, len), n)| (at, at + len, n))
        .collect();
    ranges.sort_unstable();
    for w in ranges.windows(2) {
        if w[1].0 < w[0].1 {
            return Err(Error::BadRequest(format!(
                "tensors `{}` and `{}` share memory (tied or views of one storage); pass only \
                 one of them",
                w[0].2, w[1].2
            )));
        }
    }
    Ok(())
}

fn targets(lent: &mut [LentTensor]) -> Result<Vec<Target<'_>>> {
    lent.iter_mut().map(LentTensor::target).collect()
}

/// One tensor's writes for a caller that writes its tensors itself: the
/// changed word indices and their new values.
#[derive(Debug)]
pub struct Resolved {
    /// The tensor.
    pub name: String,
    /// Changed word indices, ascending.
    pub positions: Positions,
    /// The new words, little-endian, `word_bytes` each, in position order.
    pub new_words: Vec<u8>,
    /// Bytes per word.
    pub word_bytes: usize,
}

/// Gathers a tensor's old words at `positions` for [`LentSink::resolve`]
/// (`word_bytes` each, little-endian, in position order), wherever the
/// tensor lives.
pub type Gather<'a> = dyn FnMut(&str, &Positions, usize) -> Result<Vec<u8>> + 'a;

/// What the caller's tensors hold, per the sink.
#[derive(Clone, Debug, Default)]
struct Held {
    version: Option<u64>,
    /// The tensor files of the held version (from its anchor): every delta
    /// version must move each.
    tensor_files: Option<BTreeSet<String>>,
    /// The non-tensor files handed out: (size, BLAKE3).
    files: Option<BTreeMap<String, (u64, String)>>,
    digests: BTreeMap<String, (Dtype, Vec<usize>, Digest)>,
    /// Where each tensor's memory was when the sink last wrote it.
    memory: BTreeMap<String, (usize, usize)>,
    /// Per tensor file, the `compact2` context of the held version.
    contexts: Contexts,
}

impl Held {
    /// The context of each delta's file, in order.
    fn contexts_of(&self, deltas: &[(String, Bytes)]) -> Vec<Option<&Context>> {
        deltas.iter().map(|(f, _)| self.contexts.get(f)).collect()
    }

    /// Each delta's file takes the context its apply made.
    fn set_contexts(&mut self, deltas: &[(String, Bytes)], next: Vec<Option<Context>>) {
        for ((f, _), c) in deltas.iter().zip(next) {
            self.contexts.set(f, c);
        }
    }
}

/// A tensor whose changes were decoded, and the digests it goes between.
type Decoded = (String, Option<(Digest, Digest)>);

/// A delta version staged for the caller's tensors.
#[derive(Debug, Default)]
struct Replay {
    version: u64,
    base: Option<u64>,
    /// (tensor file, verified delta object)
    deltas: Vec<(String, Bytes)>,
    /// (file, verified body) of the non-tensor files that changed.
    files: Vec<(String, Bytes)>,
    /// The non-tensor files after the version.
    files_after: Option<BTreeMap<String, (u64, String)>>,
    done: bool,
    prepared: Option<PreparedFor>,
    /// `resolve` ran: the caller writes, the headers' digests are recorded.
    resolved: bool,
    /// What `changes` decoded: each tensor and the digests it goes between
    /// (`resolve_changes` takes only those).
    decoded: Option<Vec<Decoded>>,
    /// The contexts the version makes, computed when it resolved.
    next_contexts: Option<Vec<Option<Context>>>,
}

/// Changes prepared on tensors: their memory and structure (the commit must
/// be given the same).
struct PreparedFor {
    prepared: Prepared,
    memory: HashMap<String, (usize, usize)>,
    info: HashMap<String, (Dtype, Vec<usize>)>,
}

impl std::fmt::Debug for PreparedFor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PreparedFor")
            .field("changed", &self.prepared.changed())
            .field("memory", &self.memory)
            .finish()
    }
}

#[derive(Debug)]
enum Work {
    Replay(Replay),
    /// An anchor and the versions after it, in memory.
    Bootstrap(MemorySink),
}

/// How the next commit writes.
#[derive(Default)]
enum Hand {
    #[default]
    None,
    /// Into these tensors.
    Tensors {
        tensors: Vec<LentTensor>,
        single_pass: bool,
    },
    /// The caller wrote them itself (its device path); memory by name when known.
    Written(BTreeMap<String, (usize, usize)>),
}

/// The report of a commit into lent tensors.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct LentReport {
    /// The version the tensors now hold.
    pub version: u64,
    /// `delta` or `anchor`.
    pub kind: &'static str,
    /// Changed words (a delta), or tensors written (an anchor).
    pub changed: u64,
    /// The tensors written.
    pub changed_tensors: Vec<String>,
    /// Changes written from what a prepare or verify pass kept.
    pub kept: u64,
    /// Whether the changes were prepared before the commit.
    pub prepared: bool,
    /// Whether the one-pass apply ran.
    pub single_pass: bool,
    /// Bytes written.
    pub written_bytes: u64,
}

/// Tensors a caller owns, followed in place (see the module documentation).
#[derive(Default)]
pub struct LentSink {
    held: Held,
    work: Option<Work>,
    hand: Hand,
    last: Option<LentReport>,
}

impl std::fmt::Debug for LentSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LentSink")
            .field("held", &self.held)
            .field("work", &self.work)
            .finish()
    }
}

impl LentSink {
    /// A sink for tensors that hold `version` (`None`: nothing yet, the first
    /// update is an anchor). With a version and no anchor applied through the
    /// sink, no digests are known: deltas are verified element by element
    /// (O(changed)), and [`LentSink::verify`] has nothing to check against.
    pub fn new(version: Option<u64>) -> LentSink {
        LentSink {
            held: Held {
                version,
                ..Held::default()
            },
            ..LentSink::default()
        }
    }

    /// The digests recorded for the held version: (name, dtype, shape, digest).
    pub fn digests(&self) -> impl Iterator<Item = (&str, Dtype, &[usize], Digest)> {
        self.held
            .digests
            .iter()
            .map(|(n, (d, s, g))| (n.as_str(), *d, s.as_slice(), *g))
    }

    /// The report of the last commit.
    pub fn last_report(&self) -> Option<&LentReport> {
        self.last.as_ref()
    }

    /// The staged update's kind: `delta`, `anchor`, or `None`.
    pub fn staged_kind(&self) -> Option<&'static str> {
        match &self.work {
            Some(Work::Replay(_)) => Some("delta"),
            Some(Work::Bootstrap(_)) => Some("anchor"),
            None => None,
        }
    }

    /// The staged delta objects: (tensor file, object).
    pub fn staged_deltas(&self) -> &[(String, Bytes)] {
        match &self.work {
            Some(Work::Replay(r)) => &r.deltas,
            _ => &[],
        }
    }

    /// The bytes of tensor `name` of the staged anchor.
    pub fn staged_tensor(&self, name: &str) -> Result<&[u8]> {
        self.staged_tensors()
            .into_iter()
            .flat_map(|m| m.values())
            .find_map(|set| set.position(name).map(|i| set.data(i)))
            .ok_or_else(|| Error::NotFound(format!("tensor `{name}` is not in the staged anchor")))
    }

    /// The staged anchor's tensor files (empty for a delta).
    pub fn staged_tensors(&self) -> Option<&BTreeMap<String, TensorSet>> {
        match &self.work {
            Some(Work::Bootstrap(m)) => Some(m.tensors()),
            _ => None,
        }
    }

    /// The staged update's non-tensor files: every one for an anchor, the
    /// changed ones for a delta.
    pub fn staged_files(&self) -> Vec<(&str, &[u8])> {
        match &self.work {
            Some(Work::Replay(r)) => r.files.iter().map(|(n, b)| (n.as_str(), &b[..])).collect(),
            Some(Work::Bootstrap(m)) => m
                .files()
                .iter()
                .map(|(n, b)| (n.as_str(), &b[..]))
                .collect(),
            None => Vec::new(),
        }
    }

    /// (name, dtype, shape) of every tensor the staged update writes: the
    /// changed tensors of a delta, every tensor of an anchor.
    pub fn staged_writes(&self) -> Result<Vec<(String, Dtype, Vec<usize>)>> {
        match &self.work {
            Some(Work::Replay(r)) => {
                let mut out = Vec::new();
                for (file, d) in &r.deltas {
                    let h = delta_header(file, d)?;
                    for (name, e) in h.tensors {
                        let dt = parse_dtype(&e.dtype).map_err(|_| {
                            Error::metadata(format!("tensors.{name}.dtype"), "unknown dtype")
                        })?;
                        out.push((name, dt, e.shape.iter().map(|&d| d as usize).collect()));
                    }
                }
                Ok(out)
            }
            Some(Work::Bootstrap(m)) => Ok(m
                .tensors()
                .values()
                .flat_map(|s| s.tensors())
                .map(|t| (t.name.clone(), t.dtype, t.shape.clone()))
                .collect()),
            None => Ok(Vec::new()),
        }
    }

    fn replay(&self) -> Result<&Replay> {
        match &self.work {
            Some(Work::Replay(r)) if r.done => Ok(r),
            _ => Err(Error::BadRequest(
                "no delta is staged (an anchor has no positions: copy its tensors)".into(),
            )),
        }
    }

    /// Checks that lent tensors are the memory this sink holds its version
    /// in: a tensor it wrote before must still be where it was.
    fn check_bound(
        &self,
        names: &BTreeSet<String>,
        memory: &HashMap<&str, (usize, usize)>,
    ) -> Result<()> {
        for name in names {
            let (Some(was), Some(now)) = (self.held.memory.get(name), memory.get(name.as_str()))
            else {
                continue;
            };
            if was != now {
                return Err(Error::BadRequest(format!(
                    "tensor `{name}` is not the memory this subscriber holds version {:?} in \
                     (another subscriber's tensors, or reallocated): apply updates to the \
                     tensors this subscriber manages, or poll for an anchor to adopt these",
                    self.held.version
                )));
            }
        }
        Ok(())
    }

    /// The first half of a staged delta's commit: verifies every changed
    /// element of `tensors` against the delta's base and decodes every
    /// change, writing nothing. `false`, with nothing prepared, for what
    /// cannot be held decoded (an anchor, a TRL-encoded delta): the commit
    /// then applies in one go.
    pub fn prepare(&mut self, tensors: &mut [LentTensor]) -> Result<bool> {
        check_disjoint(tensors)?;
        let Some(Work::Replay(r)) = &self.work else {
            return Ok(false);
        };
        check_structure(&r.deltas, tensors)?;
        let names = changed_names(&r.deltas)?;
        let memory: HashMap<&str, (usize, usize)> = tensors
            .iter()
            .map(|l| (l.name.as_str(), l.memory()))
            .collect();
        self.check_bound(&names, &memory)?;
        let Some(Work::Replay(r)) = &mut self.work else {
            unreachable!("checked above")
        };
        let objects: Vec<&[u8]> = r.deltas.iter().map(|d| &d.1[..]).collect();
        let contexts = self.held.contexts_of(&r.deltas);
        let prepared = match prepare_in_place_all_ctx(&mut targets(tensors)?, &objects, &contexts) {
            Err(Error::Unsupported { reason, .. }) => {
                tracing::debug!(%reason, "update not prepared; it applies in one call");
                return Ok(false);
            }
            r => r.map_err(base_mismatch)?,
        };
        tracing::debug!(
            version = r.version,
            changed = prepared.changed(),
            held_bytes = prepared.held_bytes(),
            "delta prepared"
        );
        r.prepared = Some(PreparedFor {
            prepared,
            memory: tensors
                .iter()
                .map(|l| (l.name.clone(), l.memory()))
                .collect(),
            info: structure(tensors),
        });
        Ok(true)
    }

    /// The device path of a staged delta: for every changed tensor, `gather`
    /// returns its old words at the changed positions, which are checked
    /// against the delta's base (digests); only when every tensor passed are
    /// the writes returned. Nothing is written here; the caller scatters,
    /// then commits with
    /// [`Subscriber::commit_written`](super::step::Subscriber::commit_written). [`LentSink::changes`] and
    /// [`LentSink::resolve_changes`] do the same in batches.
    pub fn resolve(&mut self, gather: &mut Gather<'_>) -> Result<Vec<Resolved>> {
        let changes = self.changes()?;
        let old = changes
            .iter()
            .map(|c| gather(&c.name, &c.positions, c.word_bytes()))
            .collect::<Result<Vec<_>>>()?;
        let mut new: Vec<Vec<u8>> = changes.iter().map(|c| vec![0; c.new_bytes()]).collect();
        {
            let old: Vec<&[u8]> = old.iter().map(|o| &o[..]).collect();
            let mut out: Vec<&mut [u8]> = new.iter_mut().map(|n| &mut n[..]).collect();
            self.resolve_changes(&changes, &old, &mut out)?;
        }
        Ok(changes
            .into_iter()
            .zip(new)
            .map(|(c, new_words)| Resolved {
                word_bytes: c.word_bytes(),
                name: c.name,
                positions: c.positions,
                new_words,
            })
            .collect())
    }

    /// The device path in batches, first half: every changed tensor's
    /// changes of the staged delta, decoded (tensors and blocks in
    /// parallel) and checked against the held version's dtypes and shapes.
    /// The caller gathers the old words at each one's positions wherever
    /// the tensors live, then calls [`LentSink::resolve_changes`].
    pub fn changes(&mut self) -> Result<Vec<Changes>> {
        let r = self.replay()?;
        let mut out = Vec::new();
        for (file, object) in &r.deltas {
            let delta = Delta::parse_ctx(object, self.held.contexts.get(file))?;
            for (name, e) in &delta.header().tensors {
                let dt = parse_dtype(&e.dtype).map_err(|_| {
                    Error::metadata(format!("tensors.{name}.dtype"), "unknown dtype")
                })?;
                if let Some((hd, hs, _)) = self.held.digests.get(name) {
                    let shape: Vec<usize> = e.shape.iter().map(|&d| d as usize).collect();
                    if (*hd, hs) != (dt, &shape) {
                        return Err(Error::BaseMismatch(format!(
                            "tensor `{name}` is {hd} {hs:?} at version {:?}; the delta has {dt} \
                             {shape:?}",
                            self.held.version
                        )));
                    }
                }
            }
            let names: Vec<&String> = delta.header().tensors.keys().collect();
            let decoded = names
                .into_par_iter()
                .map(|n| delta.changes(n))
                .collect::<Result<Vec<_>>>()?;
            out.extend(decoded);
        }
        if let Some(Work::Replay(r)) = &mut self.work {
            r.decoded = Some(out.iter().map(|c| (c.name.clone(), c.digests())).collect());
        }
        Ok(out)
    }

    /// The device path in batches, second half: `old[k]` holds the old words
    /// at `changes[k]`'s positions (as [`LentSink::changes`] returned them);
    /// writes the new words into `new[k]` after checking every tensor
    /// against the delta's base (in parallel). Only when all passed may the
    /// caller scatter `new`, then commit with
    /// [`Subscriber::commit_written`](super::step::Subscriber::commit_written).
    pub fn resolve_changes(
        &mut self,
        changes: &[Changes],
        old: &[&[u8]],
        new: &mut [&mut [u8]],
    ) -> Result<()> {
        let decoded = self.replay()?.decoded.as_deref().unwrap_or_default();
        let given: Vec<Decoded> = changes
            .iter()
            .map(|c| (c.name.clone(), c.digests()))
            .collect();
        if given != decoded {
            return Err(Error::BadRequest(
                "these changes are not the staged delta's: pass what changes() returned for this \
                 update"
                    .into(),
            ));
        }
        if changes.len() != old.len() || changes.len() != new.len() {
            return Err(Error::BadRequest(format!(
                "{} tensors of changes, {} of old words, {} of new words: give one of each per \
                 tensor",
                changes.len(),
                old.len(),
                new.len()
            )));
        }
        changes
            .par_iter()
            .zip(old.par_iter())
            .zip(new.par_iter_mut())
            .map(|((c, o), n)| c.resolve(o, n))
            .collect::<Result<Vec<()>>>()
            .map_err(base_mismatch)?;
        let next = self.next_contexts(&self.replay()?.deltas)?;
        if let Some(Work::Replay(r)) = &mut self.work {
            r.resolved = true;
            r.next_contexts = Some(next);
        }
        Ok(())
    }

    /// The `compact2` contexts the staged deltas make for the next version,
    /// decoded from the objects (`None` per file for other encodings).
    fn next_contexts(&self, deltas: &[(String, Bytes)]) -> Result<Vec<Option<Context>>> {
        deltas
            .iter()
            .map(|(file, d)| Context::of_delta(d, self.held.contexts.get(file)))
            .collect()
    }

    /// Checks every tensor given against the digest recorded for the held
    /// version (a full pass over each): (checked, unknown names, recorded
    /// names not given), or `Corrupt` naming the first tensor that differs.
    pub fn verify(
        &self,
        tensors: &[LentTensor],
    ) -> Result<(Vec<String>, Vec<String>, Vec<String>)> {
        let version = self.held.version;
        if self.held.digests.is_empty() {
            return Err(Error::NotFound(format!(
                "no digests are recorded for version {version:?}: they come with an update \
                 applied through this subscriber (an anchor records every tensor)"
            )));
        }
        let results: Vec<Option<Result<()>>> = tensors
            .par_iter()
            .map(|l| {
                let (dtype, shape, want) = self.held.digests.get(&l.name)?;
                Some((|| {
                    if (*dtype, shape) != (l.dtype, &l.shape) {
                        return Err(Error::BaseMismatch(format!(
                            "tensor `{}` is {} {:?}, version {version:?} has {} {:?}",
                            l.name, l.dtype, l.shape, dtype, shape
                        )));
                    }
                    let got = tensor_digest_of(&l.name, l.dtype, &l.shape, l.buf.bytes())?;
                    if got != *want {
                        return Err(Error::Integrity {
                            scope: format!("tensor {} of version {version:?}", l.name),
                            expected: want.to_string(),
                            actual: got.to_string(),
                        });
                    }
                    Ok(())
                })())
            })
            .collect();
        let mut checked = Vec::new();
        let mut unknown = Vec::new();
        for (l, r) in tensors.iter().zip(results) {
            match r {
                Some(r) => {
                    r?;
                    checked.push(l.name.clone());
                }
                None => unknown.push(l.name.clone()),
            }
        }
        let given: BTreeSet<&str> = tensors.iter().map(|l| l.name.as_str()).collect();
        let missing = self
            .held
            .digests
            .keys()
            .filter(|n| !given.contains(n.as_str()))
            .cloned()
            .collect();
        Ok((checked, unknown, missing))
    }

    fn commit_replay(&mut self, r: &mut Replay, hand: &mut Hand) -> Result<LentReport> {
        let mut report = LentReport {
            version: r.version,
            kind: "delta",
            ..LentReport::default()
        };
        let names = changed_names(&r.deltas)?;
        match hand {
            Hand::None => return Err(not_lent(r.version)),
            Hand::Written(memory) => {
                let memory = std::mem::take(memory);
                if !r.resolved {
                    return Err(Error::BadRequest(format!(
                        "version {} was not resolved: resolve the delta, write it, then commit",
                        r.version
                    )));
                }
                let mut changes = Vec::new();
                for (file, d) in &r.deltas {
                    let h = delta_header(file, d)?;
                    for (name, e) in h.tensors {
                        let dt = parse_dtype(&e.dtype).map_err(|_| {
                            Error::metadata(format!("tensors.{name}.dtype"), "unknown dtype")
                        })?;
                        let digest = Digest::parse(&e.digest).ok_or_else(|| {
                            Error::metadata(format!("tensors.{name}.digest"), "not a digest")
                        })?;
                        let shape = e.shape.iter().map(|&d| d as usize).collect();
                        report.changed += e.changed;
                        changes.push((name, dt, shape, digest));
                    }
                }
                report.changed_tensors = changes.iter().map(|c| c.0.clone()).collect();
                // The contexts the version makes (the caller wrote the
                // changes): made when it resolved, before the pause.
                let next = match r.next_contexts.take() {
                    Some(next) => next,
                    None => self.next_contexts(&r.deltas)?,
                };
                self.held.set_contexts(&r.deltas, next);
                self.advance(r.version, &changes);
                for (n, m) in memory {
                    if names.contains(n.as_str()) {
                        self.held.memory.insert(n, m);
                    }
                }
            }
            Hand::Tensors {
                tensors,
                single_pass,
            } => {
                let single_pass = *single_pass;
                check_structure(&r.deltas, tensors)?;
                let memory: HashMap<&str, (usize, usize)> = tensors
                    .iter()
                    .map(|l| (l.name.as_str(), l.memory()))
                    .collect();
                let info = structure(tensors);
                let mem: Vec<(String, (usize, usize))> = tensors
                    .iter()
                    .map(|l| (l.name.clone(), l.memory()))
                    .collect();
                let reports = if let Some(p) = &r.prepared {
                    for name in p.prepared.tensor_names() {
                        if memory.get(name) != p.memory.get(name) {
                            return Err(Error::BadRequest(format!(
                                "tensor `{name}` is not the memory version {} was prepared on: \
                                 commit the tensors given to prepare",
                                r.version
                            )));
                        }
                    }
                    self.check_bound(&names, &memory)?;
                    let p = r.prepared.take().expect("checked above");
                    report.prepared = true;
                    let (reports, next) = p.prepared.commit_ctx(&mut targets(tensors)?)?;
                    self.held.set_contexts(&r.deltas, next);
                    Some((reports, p.info))
                } else if let Err(e) = self.check_bound(&names, &memory) {
                    return Err(e);
                } else if single_pass
                    && let Some(digests) = self.single_pass_digests(&r.deltas, tensors)
                {
                    let (file, object) = &r.deltas[0];
                    let items = std::mem::take(tensors)
                        .into_iter()
                        .map(|l| (l.name, l.dtype, l.shape, l.buf));
                    let set = TensorSet::from_external(items);
                    let mut set = set.map_err(|e| e.in_input(format!("tensor file `{file}`")))?;
                    set.assume_digests(&digests)?;
                    // The payload is BLAKE3-checked first, so a tensor whose
                    // digest does not come out is the local base's fault.
                    let applied = crate::codec::apply_delta_ctx(
                        &mut set,
                        object,
                        self.held.contexts.get(file),
                    )
                    .map_err(base_mismatch);
                    let changes: Vec<_> = set
                        .tensors()
                        .iter()
                        .map(|t| (t.name.clone(), t.dtype, t.shape.clone(), t.digest))
                        .collect();
                    *tensors = set
                        .into_external()
                        .into_iter()
                        .map(|(name, dtype, shape, buf)| LentTensor {
                            name,
                            dtype,
                            shape,
                            buf,
                        })
                        .collect();
                    let (a, next) = applied?;
                    self.held.contexts.set(file, next);
                    let changes: Vec<_> = changes
                        .into_iter()
                        .filter(|c| a.changed_tensors.contains(&c.0))
                        .collect();
                    report.single_pass = true;
                    report.changed = a.changed;
                    report.changed_tensors = a.changed_tensors;
                    self.advance(r.version, &changes);
                    None
                } else {
                    let objects: Vec<&[u8]> = r.deltas.iter().map(|d| &d.1[..]).collect();
                    let contexts = self.held.contexts_of(&r.deltas);
                    let (reports, next) = apply_in_place_all_ctx(
                        &mut targets(tensors)?,
                        &objects,
                        &contexts,
                        &InPlaceOptions::default(),
                    )
                    .map_err(base_mismatch)?;
                    self.held.set_contexts(&r.deltas, next);
                    Some((reports, info))
                };
                if let Some((reports, info)) = reports {
                    self.record(&mut report, &reports, &info)?;
                }
                for (n, m) in mem {
                    if names.contains(n.as_str()) {
                        self.held.memory.insert(n, m);
                    }
                }
            }
        }
        if let Some(files) = r.files_after.take() {
            self.held.files = Some(files);
        }
        report.written_bytes = written_of(&r.deltas);
        Ok(report)
    }

    fn record(
        &mut self,
        report: &mut LentReport,
        reports: &[InPlaceReport],
        info: &HashMap<String, (Dtype, Vec<usize>)>,
    ) -> Result<()> {
        let mut changes = Vec::new();
        for t in reports.iter().flat_map(|r| &r.tensors) {
            let (d, s) = info
                .get(&t.name)
                .cloned()
                .ok_or_else(|| Error::tensor(&t.name, "changed, but not among the tensors"))?;
            changes.push((t.name.clone(), d, s, t.digest));
        }
        report.changed = reports.iter().map(|r| r.changed).sum();
        report.kept = reports.iter().map(|r| r.kept).sum();
        report.changed_tensors = reports
            .iter()
            .flat_map(|r| &r.tensors)
            .filter(|t| t.changed > 0)
            .map(|t| t.name.clone())
            .collect();
        self.advance(report.version, &changes);
        Ok(())
    }

    fn commit_anchor(&mut self, m: &MemorySink, hand: &mut Hand) -> Result<LentReport> {
        let (sets, files) = (m.tensors(), m.files());
        let version = m.held().ok_or_else(|| {
            Error::BadRequest("the staged anchor update did not finish a version".into())
        })?;
        let mut index: HashMap<&str, (&TensorSet, usize)> = HashMap::new();
        for (file, set) in sets {
            for (i, t) in set.tensors().iter().enumerate() {
                if index.insert(t.name.as_str(), (set, i)).is_some() {
                    return Err(Error::tensor(
                        &t.name,
                        format!("appears in two tensor files (`{file}` and another)"),
                    ));
                }
            }
        }
        let mut memory = BTreeMap::new();
        match hand {
            Hand::None => return Err(not_lent(version)),
            Hand::Written(m) => memory = std::mem::take(m),
            Hand::Tensors { tensors, .. } => {
                let by_name: HashMap<&str, usize> = tensors
                    .iter()
                    .enumerate()
                    .map(|(i, l)| (l.name.as_str(), i))
                    .collect();
                // Every tensor present with its structure, before any write.
                let mut pairs = Vec::with_capacity(index.len());
                for (name, (set, i)) in &index {
                    let t = &set.tensors()[*i];
                    let Some(&k) = by_name.get(name) else {
                        // A tied copy (the same bytes under another name
                        // given: one storage in the engine) is written
                        // with it.
                        let tied = index.iter().any(|(other, (s, j))| {
                            let o = &s.tensors()[*j];
                            other != name
                                && by_name.contains_key(other)
                                && (o.dtype, &o.shape, o.digest) == (t.dtype, &t.shape, t.digest)
                                && s.data(*j) == set.data(*i)
                        });
                        if tied {
                            continue;
                        }
                        return Err(Error::BadRequest(format!(
                            "tensor `{name}` of version {version} is not among the tensors given"
                        )));
                    };
                    let l = &tensors[k];
                    if (l.dtype, &l.shape) != (t.dtype, &t.shape) {
                        return Err(Error::BaseMismatch(format!(
                            "tensor `{name}` is {} {:?}, version {version} has {} {:?}",
                            l.dtype, l.shape, t.dtype, t.shape
                        )));
                    }
                    pairs.push((k, *set, *i));
                }
                for l in tensors.iter() {
                    if index.contains_key(l.name.as_str()) {
                        memory.insert(l.name.clone(), l.memory());
                    }
                }
                pairs.sort_unstable_by_key(|p| p.0);
                let mut slots: Vec<Option<&mut [u8]>> = Vec::with_capacity(tensors.len());
                for l in tensors.iter_mut() {
                    let name = l.name.clone();
                    slots.push(Some(l.buf.bytes_mut().ok_or_else(|| {
                        Error::BadRequest(format!("tensor `{name}` was lent read-only"))
                    })?));
                }
                let jobs: Vec<(&mut [u8], &[u8])> = pairs
                    .iter()
                    .map(|(k, set, i)| (slots[*k].take().expect("distinct"), set.data(*i)))
                    .collect();
                jobs.into_par_iter()
                    .for_each(|(dst, src)| dst.copy_from_slice(src));
            }
        }
        let changes: Vec<_> = index
            .values()
            .map(|(set, i)| {
                let t = &set.tensors()[*i];
                (t.name.clone(), t.dtype, t.shape.clone(), t.digest)
            })
            .collect();
        self.held.digests.clear();
        self.held.contexts = m.contexts().clone();
        self.held.memory = memory;
        self.held.tensor_files = Some(sets.keys().cloned().collect());
        self.held.files = Some(
            files
                .iter()
                .map(|(n, b)| {
                    (
                        n.clone(),
                        (b.len() as u64, blake3::hash(b).to_hex().to_string()),
                    )
                })
                .collect(),
        );
        self.advance(version, &changes);
        Ok(LentReport {
            version,
            kind: "anchor",
            changed: changes.len() as u64,
            changed_tensors: changes.iter().map(|c| c.0.clone()).collect(),
            written_bytes: sets.values().map(|s| s.total_bytes()).sum(),
            ..LentReport::default()
        })
    }

    /// Records a version: the held version and the changed tensors' digests.
    fn advance(&mut self, version: u64, changes: &[(String, Dtype, Vec<usize>, Digest)]) {
        for (name, dtype, shape, digest) in changes {
            self.held
                .digests
                .insert(name.clone(), (*dtype, shape.clone(), *digest));
        }
        self.held.version = Some(version);
    }

    /// The held digests of the lent tensors, in the order a [`TensorSet`]
    /// sorts them (by name), when the single-pass apply can run: one tensor
    /// file whose every tensor is lent (and nothing else), each with a
    /// recorded digest. `None`: use the verify-then-write apply.
    fn single_pass_digests(
        &self,
        deltas: &[(String, Bytes)],
        lent: &[LentTensor],
    ) -> Option<Vec<Digest>> {
        let [(file, _)] = deltas else { return None };
        let files = self.held.tensor_files.as_ref()?;
        if files.len() != 1 || !files.contains(file) || lent.len() != self.held.digests.len() {
            return None;
        }
        let mut names: Vec<&LentTensor> = lent.iter().collect();
        names.sort_unstable_by(|a, b| a.name.cmp(&b.name));
        names
            .iter()
            .map(|l| {
                let (dtype, shape, d) = self.held.digests.get(&l.name)?;
                ((*dtype, shape) == (l.dtype, &l.shape)).then_some(*d)
            })
            .collect()
    }
}

/// An update staged for the caller's tensors, described.
#[derive(Clone, Debug)]
pub struct StagedUpdate {
    /// The version it produces.
    pub version: u64,
    /// The version a delta applies to (`None`: an anchor).
    pub base: Option<u64>,
    /// `delta` or `anchor`.
    pub kind: &'static str,
    /// Bytes it holds: a delta's objects, an anchor's decoded tensors.
    pub nbytes: u64,
    /// (name, dtype, shape) of every tensor it writes.
    pub writes: Vec<(String, Dtype, Vec<usize>)>,
    /// The non-tensor files: every one for an anchor, the changed ones for a
    /// delta.
    pub files: Vec<(String, Bytes)>,
}

/// What [`LentSink::verify`] found, as a report.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Verified {
    /// The version checked against.
    pub version: Option<u64>,
    /// Tensors whose full digest matched.
    pub checked: usize,
    /// Tensors given that the version does not record.
    pub unknown: Vec<String>,
    /// Tensors the version records that were not given.
    pub not_given: Vec<String>,
}

impl Subscriber<LentSink> {
    /// The next update, staged ([`Subscriber::next_update`] then
    /// [`Subscriber::stage`]) and described; `None` when nothing is new.
    pub async fn next_staged(&mut self, opts: &StepOptions) -> Result<Option<StagedUpdate>> {
        let Some(u) = self.next_update(opts).await? else {
            return Ok(None);
        };
        let base = u.base;
        self.stage(u).await?;
        let version = self.staged().expect("staged above");
        let sink = &self.sink;
        let nbytes = match sink.staged_tensors() {
            Some(sets) => sets.values().map(|s| s.total_bytes()).sum(),
            None => sink.staged_deltas().iter().map(|d| d.1.len() as u64).sum(),
        };
        Ok(Some(StagedUpdate {
            version,
            base: base.filter(|_| sink.staged_kind() == Some("delta")),
            kind: sink.staged_kind().unwrap_or("delta"),
            nbytes,
            writes: sink.staged_writes()?,
            files: sink
                .staged_files()
                .into_iter()
                .map(|(n, b)| (n.to_string(), Bytes::copy_from_slice(b)))
                .collect(),
        }))
    }

    /// [`LentSink::prepare`]; tensors that fail verification make the next
    /// update an anchor.
    pub fn prepare(&mut self, tensors: &mut [LentTensor]) -> Result<bool> {
        let r = self.sink.prepare(tensors);
        if r.as_ref()
            .is_err_and(|e| e.kind() == crate::error::ErrorKind::Corrupt)
        {
            self.distrust_held();
        }
        r
    }

    /// [`LentSink::resolve`]; old values that fail verification make the
    /// next update an anchor.
    pub fn resolve(&mut self, gather: &mut Gather<'_>) -> Result<Vec<Resolved>> {
        let r = self.sink.resolve(gather);
        if r.as_ref()
            .is_err_and(|e| e.kind() == crate::error::ErrorKind::Corrupt)
        {
            self.distrust_held();
        }
        r
    }

    /// [`LentSink::changes`].
    pub fn changes(&mut self) -> Result<Vec<Changes>> {
        self.sink.changes()
    }

    /// [`LentSink::resolve_changes`]; old values that fail verification make
    /// the next update an anchor.
    pub fn resolve_changes(
        &mut self,
        changes: &[Changes],
        old: &[&[u8]],
        new: &mut [&mut [u8]],
    ) -> Result<()> {
        let r = self.sink.resolve_changes(changes, old, new);
        if r.as_ref()
            .is_err_and(|e| e.kind() == crate::error::ErrorKind::Corrupt)
        {
            self.distrust_held();
        }
        r
    }

    /// Records the held version in a subscriber endpoint's status
    /// (`/v1/status`, `/metrics`).
    pub fn report_to(&self, status: &super::status::Shared) {
        if let Ok(mut s) = status.status.lock() {
            let version = self.sink.held();
            if s.version != version {
                s.versions_applied += 1;
            }
            s.version = version;
            s.newest = self.newest();
            s.lag = s.newest.zip(s.version).map(|(n, v)| n.saturating_sub(v));
            s.quarantined = self.quarantined();
            s.store_requests = self.fetcher.requests();
        }
    }

    /// Checks whole tensors against the digests recorded for the held
    /// version ([`LentSink::verify`]).
    pub fn verify(&self, tensors: &[LentTensor]) -> Result<Verified> {
        let (checked, unknown, not_given) = self.sink.verify(tensors)?;
        Ok(Verified {
            version: self.sink.held(),
            checked: checked.len(),
            unknown,
            not_given,
        })
    }

    /// Commits the staged update into `tensors`, lent for this call, and
    /// gives them back, whatever the outcome (nothing keeps them). With
    /// `single_pass`, a delta onto one whole tensor file with recorded
    /// digests applies in one pass, undoing on failure, instead of
    /// verifying first.
    pub fn commit_into(
        &mut self,
        tensors: Vec<LentTensor>,
        single_pass: bool,
    ) -> (Vec<LentTensor>, Result<CaughtUp>) {
        if let Err(e) = check_disjoint(&tensors) {
            return (tensors, Err(e));
        }
        self.sink.hand = Hand::Tensors {
            tensors,
            single_pass,
        };
        let r = self.commit();
        let back = match std::mem::take(&mut self.sink.hand) {
            Hand::Tensors { tensors, .. } => tensors,
            _ => Vec::new(),
        };
        (back, r)
    }

    /// Commits the staged update, which the caller wrote into its tensors
    /// itself (a delta's [`LentSink::resolve`] writes, an anchor's tensors
    /// copied). `memory`: where each tensor is, by name, when the caller
    /// can tell.
    pub fn commit_written(&mut self, memory: BTreeMap<String, (usize, usize)>) -> Result<CaughtUp> {
        self.sink.hand = Hand::Written(memory);
        let r = self.commit();
        self.sink.hand = Hand::None;
        r
    }
}

fn not_lent(version: u64) -> Error {
    Error::BadRequest(format!(
        "version {version} has nowhere to go: lend the tensors to commit into (or say they were \
         written)"
    ))
}

/// A delta that does not verify against the caller's tensors is their
/// fault, not the bucket's: said as a base mismatch.
fn base_mismatch(e: Error) -> Error {
    match e {
        Error::Integrity {
            scope,
            expected,
            actual,
        } => Error::BaseMismatch(format!(
            "{scope}: the delta's result has digest {actual}, the publisher's is {expected}: an \
             element it changes did not hold its base value (every word written was put back)"
        )),
        e => e,
    }
}

fn structure(lent: &[LentTensor]) -> HashMap<String, (Dtype, Vec<usize>)> {
    lent.iter()
        .map(|l| (l.name.clone(), (l.dtype, l.shape.clone())))
        .collect()
}

fn delta_header(file: &str, d: &[u8]) -> Result<crate::format::Header> {
    let (_, h) = inspect(d)?;
    h.ok_or_else(|| {
        Error::metadata(
            "weightcast.format",
            format!("the delta for `{file}` is not a weightcast delta"),
        )
    })
}

/// Each lent tensor a delta changes must have the delta's dtype and shape.
fn check_structure(deltas: &[(String, Bytes)], tensors: &[LentTensor]) -> Result<()> {
    let by: HashMap<&str, &LentTensor> = tensors.iter().map(|l| (l.name.as_str(), l)).collect();
    for (file, d) in deltas {
        for (name, e) in delta_header(file, d)?.tensors {
            let Some(l) = by.get(name.as_str()) else {
                continue;
            };
            let shape: Vec<usize> = e.shape.iter().map(|&d| d as usize).collect();
            if l.dtype.to_string() != e.dtype || l.shape != shape {
                return Err(Error::BaseMismatch(format!(
                    "tensor `{name}` is {} {:?}, the delta is for {} {shape:?}",
                    l.dtype, l.shape, e.dtype
                )));
            }
        }
    }
    Ok(())
}

fn changed_names(deltas: &[(String, Bytes)]) -> Result<BTreeSet<String>> {
    let mut out = BTreeSet::new();
    for (file, d) in deltas {
        out.extend(delta_header(file, d)?.tensors.into_keys());
    }
    Ok(out)
}

fn written_of(deltas: &[(String, Bytes)]) -> u64 {
    deltas
        .iter()
        .filter_map(|(f, d)| delta_header(f, d).ok())
        .flat_map(|h| {
            h.tensors
                .values()
                .map(|e| {
                    e.changed
                        * parse_dtype(&e.dtype)
                            .map(|d| word_bytes(d) as u64)
                            .unwrap_or(0)
                })
                .collect::<Vec<_>>()
        })
        .sum()
}

impl Sink for LentSink {
    fn held(&self) -> Option<u64> {
        self.held.version
    }

    fn max_versions(&self) -> Option<usize> {
        Some(1)
    }

    fn begin(&mut self, base: Option<u64>) -> Result<()> {
        self.abort();
        self.work = Some(match base {
            None => {
                let mut m = MemorySink::new();
                m.begin(None)?;
                Work::Bootstrap(m)
            }
            Some(b) => {
                if Some(b) != self.held.version {
                    return Err(Error::BadRequest(format!(
                        "update from version {b}, the tensors hold {:?}",
                        self.held.version
                    )));
                }
                Work::Replay(Replay {
                    base: Some(b),
                    ..Replay::default()
                })
            }
        });
        Ok(())
    }

    fn anchor_dest(&mut self, _name: &str) -> Result<AnchorDest> {
        Ok(AnchorDest::Memory)
    }

    fn anchor(&mut self, name: &str, object: AnchorObject) -> Result<()> {
        match &mut self.work {
            Some(Work::Bootstrap(m)) => m.anchor(name, object),
            _ => Err(Error::BadRequest(
                "an anchor object outside a bootstrap".into(),
            )),
        }
    }

    fn delta(&mut self, version: u64, name: &str, delta: &[u8]) -> Result<ApplyReport> {
        match &mut self.work {
            Some(Work::Bootstrap(m)) => m.delta(version, name, delta),
            Some(Work::Replay(r)) => {
                if r.done {
                    return Err(Error::BadRequest(format!(
                        "a second version ({version}) in an update of the caller's tensors"
                    )));
                }
                let h = delta_header(name, delta)?;
                if h.kind != Kind::Delta || h.model_version != version || h.base_version != r.base {
                    return Err(Error::metadata(
                        "delta",
                        format!(
                            "the delta for `{name}` is not a delta from version {:?} to {version}",
                            r.base
                        ),
                    ));
                }
                r.version = version;
                r.deltas
                    .push((name.to_string(), Bytes::copy_from_slice(delta)));
                Ok(ApplyReport {
                    model_version: Some(version),
                    base_version: h.base_version,
                    encoding: h.encoding,
                    verified: true,
                    changed: h.tensors.values().map(|e| e.changed).sum(),
                    changed_tensors: h
                        .tensors
                        .iter()
                        .filter(|(_, e)| e.changed > 0)
                        .map(|(n, _)| n.clone())
                        .collect(),
                })
            }
            None => Err(Error::BadRequest("no update in progress".into())),
        }
    }

    fn file(&mut self, version: u64, name: &str, body: &[u8]) -> Result<()> {
        match &mut self.work {
            Some(Work::Bootstrap(m)) => m.file(version, name, body),
            Some(Work::Replay(r)) => {
                r.files
                    .push((name.to_string(), Bytes::copy_from_slice(body)));
                Ok(())
            }
            None => Err(Error::BadRequest("no update in progress".into())),
        }
    }

    fn version_done(&mut self, m: &Manifest) -> Result<()> {
        let held = &self.held;
        match &mut self.work {
            // The staging is private: each version it finishes is committed
            // there at once (its tensors are what the caller copies from).
            Some(Work::Bootstrap(s)) => {
                s.version_done(m)?;
                s.commit()?;
                s.begin(Some(m.version))
            }
            Some(Work::Replay(r)) => {
                r.version = m.version;
                let got: BTreeSet<String> = r.deltas.iter().map(|d| d.0.clone()).collect();
                if let Some(expected) = &held.tensor_files
                    && &got != expected
                {
                    return Err(Error::metadata(
                        "manifest",
                        format!(
                            "version {} has deltas for {got:?}, the held version's tensor files \
                             are {expected:?}",
                            m.version
                        ),
                    ));
                }
                if let Some(files) = &held.files {
                    let mut have = files.clone();
                    for (n, b) in &r.files {
                        have.insert(
                            n.clone(),
                            (b.len() as u64, blake3::hash(b).to_hex().to_string()),
                        );
                    }
                    let gone = check_version(m, false, got.iter().cloned(), &got, &have)?;
                    for n in gone {
                        have.remove(&n);
                    }
                    r.files_after = Some(have);
                }
                r.done = true;
                tracing::info!(
                    version = m.version,
                    bytes = r.deltas.iter().map(|d| d.1.len()).sum::<usize>(),
                    "delta update ready"
                );
                Ok(())
            }
            None => Err(Error::BadRequest("no update in progress".into())),
        }
    }

    fn commit(&mut self) -> Result<Produced> {
        let mut hand = std::mem::take(&mut self.hand);
        let work = self
            .work
            .take()
            .ok_or_else(|| Error::BadRequest("no update in progress".into()))?;
        let started = std::time::Instant::now();
        let report = match work {
            // Nothing is written unless everything verified: a refused
            // commit keeps the update staged, for a retry with the right
            // tensors (the loop makes the next update an anchor when the
            // tensors failed verification).
            Work::Replay(mut r) if r.done => {
                let done = self.commit_replay(&mut r, &mut hand);
                self.hand = hand;
                match done {
                    Ok(rep) => rep,
                    Err(e) => {
                        self.work = Some(Work::Replay(r));
                        return Err(e);
                    }
                }
            }
            Work::Replay(_) => {
                return Err(Error::BadRequest("the staged version is incomplete".into()));
            }
            Work::Bootstrap(m) => {
                let done = self.commit_anchor(&m, &mut hand);
                self.hand = hand;
                match done {
                    Ok(rep) => rep,
                    Err(e) => {
                        self.work = Some(Work::Bootstrap(m));
                        return Err(e);
                    }
                }
            }
        };
        tracing::info!(
            version = report.version,
            kind = report.kind,
            changed = report.changed,
            seconds = started.elapsed().as_secs_f64(),
            prepared = report.prepared,
            "update written to the caller's tensors"
        );
        let written = report.written_bytes;
        self.last = Some(report);
        Ok(Produced {
            written_bytes: written,
            ..Produced::default()
        })
    }

    fn abort(&mut self) {
        self.work = None;
        self.hand = Hand::None;
    }
}
