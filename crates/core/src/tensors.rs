//! A set of named tensors, each a byte range of a buffer.
//!
//! A [`TensorSet`] describes each tensor as a byte range of one of its
//! buffers: a whole safetensors file read into memory or memory-mapped (then
//! ranges are file offsets, so a mapped file is patched in place), or
//! buffers the caller owns (a trainer's tensors, handed over without a copy;
//! see [`ExternalBuffer`]). Applying a delta mutates the tensors in place.
//! Each tensor carries its additive [`Digest`], maintained incrementally by the
//! codec.

use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::ops::Range;
use std::path::Path;

use rayon::prelude::*;
use safetensors::SafeTensors;

use crate::digest::{Digest, TensorSeed, tensor_digest};
use crate::dtype::{Dtype, byte_len, element_count, word_bytes};
use crate::error::{Error, Result};

/// One tensor of a [`TensorSet`].
#[derive(Clone, Debug)]
pub struct TensorInfo {
    /// Name as in the checkpoint.
    pub name: String,
    /// Element type.
    pub dtype: Dtype,
    /// Shape (C order).
    pub shape: Vec<usize>,
    /// Byte range of the data inside its buffer (for a set read or mapped
    /// from a safetensors file: the offsets in the file).
    pub range: Range<usize>,
    /// Which of the set's buffers holds the data.
    pub buf: usize,
    /// Seed of the element hash (derived from name, dtype, shape).
    pub seed: TensorSeed,
    /// Additive digest of the current bytes (valid when the set's digests are).
    pub digest: Digest,
}

impl TensorInfo {
    /// Number of elements (1 for a 0-d tensor).
    pub fn elements(&self) -> u64 {
        element_count(&self.shape).unwrap_or(0)
    }

    /// Number of diff words (see [`crate::dtype::word_bytes`]).
    pub fn words(&self) -> usize {
        self.range.len() / word_bytes(self.dtype)
    }
}

/// Whether to compute digests when loading.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Digests {
    /// Full pass over every tensor (cost proportional to the model).
    Compute,
    /// Leave digests unset; [`TensorSet::has_digests`] is false until something sets them.
    Skip,
}

/// Memory a caller owns and lends to a [`TensorSet`] (e.g. a Python
/// tensor's storage): the set reads it, and writes it only through
/// [`ExternalBuffer::bytes_mut`].
pub trait ExternalBuffer: Send + Sync {
    /// The bytes.
    fn bytes(&self) -> &[u8];
    /// The bytes for writing, if the owner allows writes.
    fn bytes_mut(&mut self) -> Option<&mut [u8]>;
}

/// A tensor over memory the caller lends: name, dtype, shape, memory (what
/// [`TensorSet::from_external`] takes and [`TensorSet::into_external`] gives
/// back).
pub type ExternalTensor = (String, Dtype, Vec<usize>, Box<dyn ExternalBuffer>);

impl ExternalBuffer for Vec<u8> {
    fn bytes(&self) -> &[u8] {
        self
    }
    fn bytes_mut(&mut self) -> Option<&mut [u8]> {
        Some(self)
    }
}

impl ExternalBuffer for bytes::Bytes {
    fn bytes(&self) -> &[u8] {
        self
    }
    fn bytes_mut(&mut self) -> Option<&mut [u8]> {
        None
    }
}

/// Where a [`TensorSet`]'s bytes live.
pub enum Buffer {
    /// Owned memory.
    Owned(Vec<u8>),
    /// A file mapped read-only.
    Mapped(memmap2::Mmap),
    /// A file mapped for writing (shared: writes reach the file).
    MappedMut(memmap2::MmapMut),
    /// A file mapped copy-on-write (private: writes go to this process's
    /// memory, page by page, never to the file).
    MappedPrivate(memmap2::MmapMut),
    /// Memory lent by the caller.
    External(Box<dyn ExternalBuffer>),
}

impl std::fmt::Debug for Buffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match self {
            Buffer::Owned(_) => "Owned",
            Buffer::Mapped(_) => "Mapped",
            Buffer::MappedMut(_) => "MappedMut",
            Buffer::MappedPrivate(_) => "MappedPrivate",
            Buffer::External(_) => "External",
        };
        write!(f, "{kind}({} bytes)", self.len())
    }
}

impl std::ops::Deref for Buffer {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Buffer::Owned(v) => v,
            Buffer::Mapped(m) => m,
            Buffer::MappedMut(m) | Buffer::MappedPrivate(m) => m,
            Buffer::External(e) => e.bytes(),
        }
    }
}

impl Buffer {
    /// The bytes for writing; a read-only mapping or a read-only external
    /// buffer is copied into owned memory first (copy on write).
    fn writable(&mut self) -> &mut [u8] {
        let read_only = match self {
            Buffer::Mapped(_) => true,
            Buffer::External(e) => e.bytes_mut().is_none(),
            _ => false,
        };
        if read_only {
            *self = Buffer::Owned(self.to_vec());
        }
        match self {
            Buffer::Owned(v) => v,
            Buffer::MappedMut(m) | Buffer::MappedPrivate(m) => m,
            Buffer::External(e) => e.bytes_mut().expect("checked writable"),
            Buffer::Mapped(_) => unreachable!("copied above"),
        }
    }

    /// Whether writes reach memory or a file that someone else owns (a
    /// mapping or an external buffer), rather than a private copy.
    pub fn is_shared(&self) -> bool {
        !matches!(self, Buffer::Owned(_) | Buffer::MappedPrivate(_))
    }
}

/// Named tensors over one or more buffers, sorted by name.
#[derive(Debug)]
pub struct TensorSet {
    bufs: Vec<Buffer>,
    tensors: Vec<TensorInfo>,
    index: HashMap<String, usize>,
    metadata: BTreeMap<String, String>,
    digests_valid: bool,
}

impl Clone for TensorSet {
    /// A copy in owned memory (mapped and external buffers are copied).
    fn clone(&self) -> Self {
        TensorSet {
            bufs: self
                .bufs
                .iter()
                .map(|b| Buffer::Owned(b.to_vec()))
                .collect(),
            tensors: self.tensors.clone(),
            index: self.index.clone(),
            metadata: self.metadata.clone(),
            digests_valid: self.digests_valid,
        }
    }
}

impl TensorSet {
    /// Parses a safetensors image, validating the container (header size, offsets,
    /// coverage, dtype/shape/length agreement) through the `safetensors` crate.
    pub fn from_safetensors(buf: Vec<u8>, digests: Digests) -> Result<Self> {
        Self::from_buffer(Buffer::Owned(buf), digests)
    }

    /// Parses a safetensors image held in any [`Buffer`] (see
    /// [`TensorSet::from_safetensors`]).
    pub fn from_buffer(buf: Buffer, digests: Digests) -> Result<Self> {
        let (n, meta) =
            SafeTensors::read_metadata(&buf).map_err(|e| Error::Container(e.to_string()))?;
        let data_start = 8 + n;
        let mut tensors: Vec<TensorInfo> = meta
            .tensors()
            .into_iter()
            .map(|(name, info)| {
                let (a, b) = info.data_offsets;
                TensorInfo {
                    seed: TensorSeed::new(&name, info.dtype, &info.shape),
                    name,
                    dtype: info.dtype,
                    shape: info.shape.clone(),
                    range: data_start + a..data_start + b,
                    buf: 0,
                    digest: Digest::default(),
                }
            })
            .collect();
        tensors.sort_by(|a, b| a.name.cmp(&b.name));
        let metadata = meta
            .metadata()
            .clone()
            .unwrap_or_default()
            .into_iter()
            .collect();
        let mut set = TensorSet {
            bufs: vec![buf],
            index: HashMap::new(),
            tensors,
            metadata,
            digests_valid: false,
        };
        set.reindex();
        if digests == Digests::Compute {
            set.compute_digests();
        }
        Ok(set)
    }

    /// Reads and parses a safetensors file.
    pub fn read(path: &Path, digests: Digests) -> Result<Self> {
        let buf =
            std::fs::read(path).map_err(|e| Error::io(format!("reading {}", path.display()), e))?;
        Self::from_safetensors(buf, digests)
            .map_err(|e| Error::Container(format!("{}: {e}", path.display())))
    }

    /// Maps a safetensors file: read-only, or for writing (`writable`; writes
    /// through [`TensorSet::data_mut`] and the codec's apply reach the file).
    ///
    /// The file must not be truncated while mapped (reading a page past the
    /// new end raises SIGBUS): map only files this process owns, such as its
    /// own state, or — read-only — a file whose writer is done with it and
    /// whose stamp the caller checks again before every read (the
    /// publisher's checkpoints: see `Snapshot::base_holds` in the
    /// `weightcast` crate).
    pub fn map(path: &Path, writable: bool, digests: Digests) -> Result<Self> {
        let io = |e| Error::io(format!("mapping {}", path.display()), e);
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(writable)
            .open(path)
            .map_err(io)?;
        // SAFETY: memory-mapping is unsafe because another process may change
        // or truncate the file while it is mapped (Rust's aliasing rules do
        // not cover that, and truncation raises SIGBUS). `map` is documented
        // to be used only on files this process owns (its state directory and
        // output slots), which nothing else writes, or read-only on files
        // their writer has finished, re-checked by stamp before each read;
        // the mapping lives inside the returned set.
        let buf = unsafe {
            if writable {
                Buffer::MappedMut(memmap2::MmapMut::map_mut(&file).map_err(io)?)
            } else {
                Buffer::Mapped(memmap2::Mmap::map(&file).map_err(io)?)
            }
        };
        Self::from_buffer(buf, digests)
            .map_err(|e| Error::Container(format!("{}: {e}", path.display())))
    }

    /// Maps a safetensors file copy-on-write: reads come from the file (the
    /// page cache), writes — through [`TensorSet::data_mut`] and the codec's
    /// apply — go to private memory of this process, a page at a time, and
    /// never reach the file. The same care as [`TensorSet::map`]: only a file
    /// this process owns, which nothing rewrites while it is mapped.
    pub fn map_private(path: &Path, digests: Digests) -> Result<Self> {
        let io = |e| Error::io(format!("mapping {}", path.display()), e);
        let file = std::fs::File::open(path).map_err(io)?;
        // SAFETY: as in `map`: the file is this process's own state, which
        // nothing else writes or truncates; writes go to private pages.
        let buf = unsafe {
            Buffer::MappedPrivate(memmap2::MmapOptions::new().map_copy(&file).map_err(io)?)
        };
        Self::from_buffer(buf, digests)
            .map_err(|e| Error::Container(format!("{}: {e}", path.display())))
    }

    /// Builds a set over buffers the caller lends (one per tensor: name,
    /// dtype, shape, bytes), without copying them. Digests are not computed.
    pub fn from_external<I>(items: I) -> Result<Self>
    where
        I: IntoIterator<Item = (String, Dtype, Vec<usize>, Box<dyn ExternalBuffer>)>,
    {
        let mut items: Vec<_> = items.into_iter().collect();
        items.sort_by(|a, b| a.0.cmp(&b.0));
        let mut bufs = Vec::with_capacity(items.len());
        let mut tensors = Vec::with_capacity(items.len());
        for (name, dtype, shape, data) in items {
            if tensors.last().is_some_and(|t: &TensorInfo| t.name == name) {
                return Err(Error::tensor(&name, "duplicate tensor name"));
            }
            let expect = byte_len(dtype, &shape)
                .ok_or_else(|| Error::tensor(&name, "shape overflows or is not byte-aligned"))?;
            let len = data.bytes().len();
            if expect != len {
                return Err(Error::tensor(
                    &name,
                    format!("{len} bytes given, dtype {dtype} and shape {shape:?} need {expect}"),
                ));
            }
            tensors.push(TensorInfo {
                seed: TensorSeed::new(&name, dtype, &shape),
                name,
                dtype,
                shape,
                range: 0..len,
                buf: bufs.len(),
                digest: Digest::default(),
            });
            bufs.push(Buffer::External(data));
        }
        let mut set = TensorSet {
            bufs,
            tensors,
            index: HashMap::new(),
            metadata: BTreeMap::new(),
            digests_valid: false,
        };
        set.reindex();
        Ok(set)
    }

    /// The buffers lent with [`TensorSet::from_external`], given back with
    /// each tensor's name, dtype and shape (sorted by name); a tensor over
    /// any other kind of buffer is dropped.
    pub fn into_external(self) -> Vec<ExternalTensor> {
        let mut bufs: Vec<Option<Buffer>> = self.bufs.into_iter().map(Some).collect();
        self.tensors
            .into_iter()
            .filter_map(|t| match bufs.get_mut(t.buf)?.take()? {
                Buffer::External(b) => Some((t.name, t.dtype, t.shape, b)),
                _ => None,
            })
            .collect()
    }

    /// One set holding every tensor of `sets` (no copy: each keeps its
    /// buffer). Names must be unique across them; the metadata is the first
    /// set's. Digests stay valid if they were valid in every set.
    pub fn merge(sets: Vec<TensorSet>) -> Result<TensorSet> {
        let valid = sets.iter().all(|s| s.digests_valid);
        let metadata = sets.first().map(|s| s.metadata.clone()).unwrap_or_default();
        let mut bufs = Vec::new();
        let mut tensors = Vec::new();
        for set in sets {
            let base = bufs.len();
            bufs.extend(set.bufs);
            tensors.extend(set.tensors.into_iter().map(|mut t| {
                t.buf += base;
                t
            }));
        }
        tensors.sort_by(|a, b| a.name.cmp(&b.name));
        if let Some(w) = tensors.windows(2).find(|w| w[0].name == w[1].name) {
            return Err(Error::tensor(
                &w[0].name,
                "appears in two tensor files; a single-file layout cannot hold both",
            ));
        }
        let mut set = TensorSet {
            bufs,
            tensors,
            index: HashMap::new(),
            metadata,
            digests_valid: valid,
        };
        set.reindex();
        Ok(set)
    }

    /// Sets every tensor's digest from a trusted record (the caller's own
    /// state, verified earlier), without a pass over the data. `digests` is in
    /// the order of [`TensorSet::tensors`].
    pub fn assume_digests(&mut self, digests: &[Digest]) -> Result<()> {
        if digests.len() != self.tensors.len() {
            return Err(Error::metadata(
                "digests",
                format!("{} given for {} tensors", digests.len(), self.tensors.len()),
            ));
        }
        for (t, d) in self.tensors.iter_mut().zip(digests) {
            t.digest = *d;
        }
        self.digests_valid = true;
        Ok(())
    }

    /// Replaces the `__metadata__` carried with the set.
    pub fn set_metadata(&mut self, metadata: BTreeMap<String, String>) {
        self.metadata = metadata;
    }

    /// Whether the set's bytes live in a mapping or caller memory that writes
    /// reach (rather than private memory).
    pub fn is_shared(&self) -> bool {
        self.bufs.iter().any(Buffer::is_shared)
    }

    /// Faults the pages of a copy-on-write mapping ([`TensorSet::map_private`])
    /// in writable at once (`MADV_POPULATE_WRITE`): each page is copied to
    /// private memory now rather than at its first write, where a page
    /// already mapped for reading costs a TLB shootdown across the process's
    /// threads (measured: three quarters of a publish over an overlay, in a
    /// VM). For sets about to be patched at densities that touch every page
    /// (an RL step changes about one bf16 element in 70: every 4 KiB page).
    /// Returns whether the kernel did it; a no-op for other buffers and
    /// before Linux 5.14 (the pages then fault one by one, as before).
    pub fn populate_private(&mut self) -> bool {
        let mut done = false;
        for b in &mut self.bufs {
            if let Buffer::MappedPrivate(m) = b {
                done |= m.advise(memmap2::Advice::PopulateWrite).is_ok();
            }
        }
        done
    }

    /// Flushes writes to mapped files (no-op for memory).
    pub fn flush(&self) -> Result<()> {
        for b in &self.bufs {
            if let Buffer::MappedMut(m) = b {
                m.flush()
                    .map_err(|e| Error::io("flushing a mapped file", e))?;
            }
        }
        Ok(())
    }

    /// Builds a set from owned tensors (name, dtype, shape, little-endian bytes)
    /// and computes their digests.
    pub fn from_tensors<I>(items: I) -> Result<Self>
    where
        I: IntoIterator<Item = (String, Dtype, Vec<usize>, Vec<u8>)>,
    {
        let mut set = Self::from_tensors_unhashed(items)?;
        set.compute_digests();
        Ok(set)
    }

    /// [`TensorSet::from_tensors`] without computing digests.
    pub fn from_tensors_unhashed<I>(items: I) -> Result<Self>
    where
        I: IntoIterator<Item = (String, Dtype, Vec<usize>, Vec<u8>)>,
    {
        let mut items: Vec<_> = items.into_iter().collect();
        items.sort_by(|a, b| a.0.cmp(&b.0));
        for w in items.windows(2) {
            if w[0].0 == w[1].0 {
                return Err(Error::tensor(&w[0].0, "duplicate tensor name"));
            }
        }
        let total: usize = items.iter().map(|t| t.3.len()).sum();
        let mut buf = Vec::with_capacity(total);
        let mut tensors = Vec::with_capacity(items.len());
        for (name, dtype, shape, data) in items {
            let expect = byte_len(dtype, &shape)
                .ok_or_else(|| Error::tensor(&name, "shape overflows or is not byte-aligned"))?;
            if expect != data.len() {
                return Err(Error::tensor(
                    &name,
                    format!("{} bytes given, dtype and shape need {expect}", data.len()),
                ));
            }
            let start = buf.len();
            buf.extend_from_slice(&data);
            tensors.push(TensorInfo {
                seed: TensorSeed::new(&name, dtype, &shape),
                name,
                dtype,
                shape,
                range: start..buf.len(),
                buf: 0,
                digest: Digest::default(),
            });
        }
        Ok(TensorSet::assemble(vec![buf], tensors, BTreeMap::new()))
    }

    /// A zero-filled set with these tensors (digests not computed): for writers
    /// that fill tensors in place, without a second copy.
    pub fn zeroed<I>(items: I) -> Result<Self>
    where
        I: IntoIterator<Item = (String, Dtype, Vec<usize>)>,
    {
        let mut items: Vec<_> = items.into_iter().collect();
        items.sort_by(|a, b| a.0.cmp(&b.0));
        let mut tensors = Vec::with_capacity(items.len());
        let mut total = 0usize;
        for (name, dtype, shape) in items {
            if tensors.last().is_some_and(|t: &TensorInfo| t.name == name) {
                return Err(Error::tensor(&name, "duplicate tensor name"));
            }
            let len = byte_len(dtype, &shape)
                .ok_or_else(|| Error::tensor(&name, "shape overflows or is not byte-aligned"))?;
            let end = total
                .checked_add(len)
                .ok_or_else(|| Error::tensor(&name, "set too large"))?;
            tensors.push(TensorInfo {
                seed: TensorSeed::new(&name, dtype, &shape),
                name,
                dtype,
                shape,
                range: total..end,
                buf: 0,
                digest: Digest::default(),
            });
            total = end;
        }
        Ok(TensorSet::assemble(
            vec![vec![0u8; total]],
            tensors,
            BTreeMap::new(),
        ))
    }

    fn assemble(
        bufs: Vec<Vec<u8>>,
        tensors: Vec<TensorInfo>,
        metadata: BTreeMap<String, String>,
    ) -> Self {
        let mut set = TensorSet {
            bufs: bufs.into_iter().map(Buffer::Owned).collect(),
            tensors,
            index: HashMap::new(),
            metadata,
            digests_valid: false,
        };
        set.reindex();
        set
    }

    fn reindex(&mut self) {
        self.index = self
            .tensors
            .iter()
            .enumerate()
            .map(|(i, t)| (t.name.clone(), i))
            .collect();
    }

    /// Every tensor's digest of its current bytes (a full pass, parallel),
    /// in tensor order.
    pub fn full_digests(&self) -> Vec<Digest> {
        self.tensors
            .par_iter()
            .map(|t| tensor_digest(t.seed, t.dtype, &self.bufs[t.buf][t.range.clone()]))
            .collect()
    }

    /// Recomputes every tensor's digest (a full pass, parallel).
    pub fn compute_digests(&mut self) {
        let digests = self.full_digests();
        for (t, d) in self.tensors.iter_mut().zip(digests) {
            t.digest = d;
        }
        self.digests_valid = true;
    }

    /// Whether the per-tensor digests describe the current bytes.
    pub fn has_digests(&self) -> bool {
        self.digests_valid
    }

    pub(crate) fn set_digest(&mut self, i: usize, d: Digest) {
        self.tensors[i].digest = d;
    }

    pub(crate) fn mark_digests_valid(&mut self) {
        self.digests_valid = true;
    }

    /// The tensors, sorted by name.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// Index of the tensor called `name`.
    pub fn position(&self, name: &str) -> Option<usize> {
        self.index.get(name).copied()
    }

    /// Bytes of tensor `i`.
    pub fn data(&self, i: usize) -> &[u8] {
        let t = &self.tensors[i];
        &self.bufs[t.buf][t.range.clone()]
    }

    /// Mutable bytes of tensor `i`. Callers that change bytes are responsible for
    /// keeping the digest right (the codec does); others should call
    /// [`TensorSet::compute_digests`] afterwards.
    pub fn data_mut(&mut self, i: usize) -> &mut [u8] {
        let t = &self.tensors[i];
        let r = t.range.clone();
        &mut self.bufs[t.buf].writable()[r]
    }

    /// Mutable bytes of every tensor at once, in the order of [`TensorSet::tensors`].
    pub fn all_data_mut(&mut self) -> Vec<&mut [u8]> {
        // Within a buffer ranges are disjoint; walk each buffer in offset
        // order and split. Empty tensors may share their start with the next
        // tensor: order by end too.
        let mut order: Vec<usize> = (0..self.tensors.len()).collect();
        let key = |t: &TensorInfo| (t.buf, t.range.start, t.range.end);
        order.sort_by_key(|&i| key(&self.tensors[i]));
        let mut out: Vec<Option<&mut [u8]>> = (0..self.tensors.len()).map(|_| None).collect();
        let mut rests: Vec<(&mut [u8], usize)> = self
            .bufs
            .iter_mut()
            .map(|b| (b.writable(), 0usize))
            .collect();
        for i in order {
            let t = &self.tensors[i];
            let (rest, consumed) = &mut rests[t.buf];
            let tail = std::mem::take(rest);
            let (_, tail) = tail.split_at_mut(t.range.start - *consumed);
            let (mine, tail) = tail.split_at_mut(t.range.len());
            out[i] = Some(mine);
            *rest = tail;
            *consumed = t.range.end;
        }
        out.into_iter()
            .map(|s| s.expect("every tensor visited"))
            .collect()
    }

    /// The `__metadata__` of the file this set was read from.
    pub fn metadata(&self) -> &BTreeMap<String, String> {
        &self.metadata
    }

    /// Sum of the tensors' digests.
    pub fn digest(&self) -> Digest {
        self.tensors
            .iter()
            .fold(Digest::default(), |acc, t| acc.wrapping_add(t.digest))
    }

    /// Total elements over all tensors.
    pub fn total_elements(&self) -> u64 {
        self.tensors.iter().map(|t| t.elements()).sum()
    }

    /// Total data bytes over all tensors.
    pub fn total_bytes(&self) -> u64 {
        self.tensors.iter().map(|t| t.range.len() as u64).sum()
    }

    /// Number of tensors.
    pub fn len(&self) -> usize {
        self.tensors.len()
    }

    /// Whether the set holds no tensor.
    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }

    /// Checks that `other` has exactly the same tensor names, dtypes and shapes.
    pub fn same_structure(&self, other: &TensorSet) -> Result<()> {
        if self.tensors.len() != other.tensors.len() {
            return Err(Error::StructureChanged(format!(
                "{} tensors before, {} now",
                self.tensors.len(),
                other.tensors.len()
            )));
        }
        for (a, b) in self.tensors.iter().zip(&other.tensors) {
            if a.name != b.name {
                return Err(Error::StructureChanged(format!(
                    "tensor `{}` vs `{}`",
                    a.name, b.name
                )));
            }
            if a.dtype != b.dtype || a.shape != b.shape {
                return Err(Error::StructureChanged(format!(
                    "tensor `{}`: {} {:?} before, {} {:?} now",
                    a.name, a.dtype, a.shape, b.dtype, b.shape
                )));
            }
        }
        Ok(())
    }

    /// Writes the set as a safetensors file with `metadata` (see
    /// [`write_safetensors`]).
    pub fn write_to(&self, metadata: &BTreeMap<String, String>, w: &mut impl Write) -> Result<()> {
        let views: Vec<(&str, Dtype, &[usize], &[u8])> = self
            .tensors
            .iter()
            .map(|t| {
                (
                    t.name.as_str(),
                    t.dtype,
                    t.shape.as_slice(),
                    &self.bufs[t.buf][t.range.clone()],
                )
            })
            .collect();
        write_safetensors(&views, metadata, w)
    }
}

/// Writes a safetensors file deterministically: tensors in the given order,
/// contiguous; JSON keys sorted; header padded with spaces to a multiple of 8.
///
/// Written here rather than with `safetensors::serialize` because that one
/// iterates a `HashMap` for `__metadata__` (byte order varies between runs) and
/// needs the whole file in memory, while anchors are streamed.
pub fn write_safetensors(
    tensors: &[(&str, Dtype, &[usize], &[u8])],
    metadata: &BTreeMap<String, String>,
    w: &mut impl Write,
) -> Result<()> {
    let header = safetensors_header(tensors, metadata)?;
    let io = |e| Error::io("writing safetensors", e);
    w.write_all(&(header.len() as u64).to_le_bytes())
        .map_err(io)?;
    w.write_all(&header).map_err(io)?;
    for (_, _, _, data) in tensors {
        w.write_all(data).map_err(io)?;
    }
    Ok(())
}

/// The padded JSON header of [`write_safetensors`].
pub fn safetensors_header(
    tensors: &[(&str, Dtype, &[usize], &[u8])],
    metadata: &BTreeMap<String, String>,
) -> Result<Vec<u8>> {
    let lens: Vec<(&str, Dtype, &[usize], usize)> = tensors
        .iter()
        .map(|&(n, d, s, data)| (n, d, s, data.len()))
        .collect();
    safetensors_header_lens(&lens, metadata)
}

/// [`safetensors_header`] from the tensors' byte lengths alone, for writers
/// that produce the data after the header is known (or before it, spilled).
pub fn safetensors_header_lens(
    tensors: &[(&str, Dtype, &[usize], usize)],
    metadata: &BTreeMap<String, String>,
) -> Result<Vec<u8>> {
    let mut map = serde_json::Map::new();
    if !metadata.is_empty() {
        map.insert(
            "__metadata__".into(),
            serde_json::to_value(metadata).expect("strings"),
        );
    }
    let mut offset = 0usize;
    for &(name, dtype, shape, len) in tensors {
        if name == "__metadata__" || map.contains_key(name) {
            return Err(Error::tensor(name, "duplicate or reserved tensor name"));
        }
        match byte_len(dtype, shape) {
            Some(n) if n == len => {}
            _ => {
                return Err(Error::tensor(
                    name,
                    format!("{len} bytes do not match dtype {dtype} and shape {shape:?}"),
                ));
            }
        }
        map.insert(
            name.to_string(),
            serde_json::json!({
                "dtype": dtype.to_string(),
                "shape": shape,
                "data_offsets": [offset, offset + len],
            }),
        );
        offset += len;
    }
    let mut header = serde_json::to_vec(&map).expect("json");
    while !header.len().is_multiple_of(8) {
        header.push(b' ');
    }
    Ok(header)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn written_files_parse_with_the_safetensors_crate() {
        let set = TensorSet::from_tensors(vec![
            (
                "b".to_string(),
                Dtype::BF16,
                vec![2, 2],
                vec![1, 2, 3, 4, 5, 6, 7, 8],
            ),
            ("a".to_string(), Dtype::F32, vec![], vec![0, 0, 128, 63]),
            ("e".to_string(), Dtype::I8, vec![0], vec![]),
        ])
        .unwrap();
        let mut meta = BTreeMap::new();
        meta.insert("format".to_string(), "pt".to_string());
        let mut out = Vec::new();
        set.write_to(&meta, &mut out).unwrap();
        let st = SafeTensors::deserialize(&out).unwrap();
        assert_eq!(st.tensor("b").unwrap().data(), &[1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(st.tensor("a").unwrap().shape(), &[] as &[usize]);
        let back = TensorSet::from_safetensors(out.clone(), Digests::Compute).unwrap();
        assert_eq!(back.digest(), set.digest());
        assert_eq!(
            back.metadata().get("format").map(String::as_str),
            Some("pt")
        );
        // Deterministic bytes.
        let mut again = Vec::new();
        back.write_to(&meta, &mut again).unwrap();
        assert_eq!(out, again);
    }

    #[test]
    fn rejects_bad_inputs() {
        assert!(
            TensorSet::from_tensors(vec![("a".into(), Dtype::F32, vec![2], vec![0; 4])]).is_err()
        );
        assert!(
            TensorSet::from_tensors(vec![
                ("a".into(), Dtype::U8, vec![1], vec![0]),
                ("a".into(), Dtype::U8, vec![1], vec![0]),
            ])
            .is_err()
        );
        assert!(TensorSet::from_safetensors(vec![1, 2, 3], Digests::Skip).is_err());
    }

    #[test]
    fn all_data_mut_splits_every_tensor() {
        let mut set = TensorSet::from_tensors(vec![
            ("x".to_string(), Dtype::U8, vec![2], vec![1, 2]),
            ("y".to_string(), Dtype::U8, vec![1], vec![3]),
        ])
        .unwrap();
        let parts = set.all_data_mut();
        assert_eq!(parts.len(), 2);
        assert_eq!(&*parts[0], &[1, 2]);
        assert_eq!(&*parts[1], &[3]);
    }

    #[test]
    fn a_writable_mapping_patches_the_file_in_place() {
        let set = TensorSet::from_tensors(vec![
            ("a".to_string(), Dtype::U8, vec![3], vec![1, 2, 3]),
            ("b".to_string(), Dtype::U8, vec![2], vec![4, 5]),
        ])
        .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.safetensors");
        let mut f = std::fs::File::create(&path).unwrap();
        set.write_to(&BTreeMap::new(), &mut f).unwrap();
        drop(f);
        let before = std::fs::read(&path).unwrap();
        {
            let mut mapped = TensorSet::map(&path, true, Digests::Compute).unwrap();
            assert!(mapped.is_shared());
            assert_eq!(mapped.digest(), set.digest());
            let i = mapped.position("b").unwrap();
            mapped.data_mut(i)[1] = 9;
            mapped.flush().unwrap();
        }
        let after = std::fs::read(&path).unwrap();
        let changed: Vec<usize> = (0..after.len())
            .filter(|&k| after[k] != before[k])
            .collect();
        assert_eq!(
            changed,
            vec![after.len() - 1],
            "only that byte of the file changed"
        );
        // A read-only mapping copies on write: the file stays as it is.
        let mut ro = TensorSet::map(&path, false, Digests::Skip).unwrap();
        let i = ro.position("a").unwrap();
        ro.data_mut(i)[0] = 7;
        assert_eq!(std::fs::read(&path).unwrap(), after);
        assert!(!ro.is_shared(), "the written buffer is now a private copy");
    }

    #[test]
    fn a_private_mapping_never_writes_the_file() {
        let set = TensorSet::from_tensors(vec![(
            "a".to_string(),
            Dtype::U8,
            vec![4096 * 3],
            vec![1; 4096 * 3],
        )])
        .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.safetensors");
        let mut f = std::fs::File::create(&path).unwrap();
        set.write_to(&BTreeMap::new(), &mut f).unwrap();
        drop(f);
        let before = std::fs::read(&path).unwrap();
        let mut private = TensorSet::map_private(&path, Digests::Compute).unwrap();
        assert!(!private.is_shared());
        // Prefaulted writable: still private, still the file's bytes.
        // (`false` only before Linux 5.14, where the pages fault one by one.)
        let _ = private.populate_private();
        assert_eq!(private.digest(), set.digest());
        private.data_mut(0)[5000] = 9;
        private.flush().unwrap();
        assert_eq!(private.data(0)[5000], 9, "the process sees its write");
        assert_eq!(std::fs::read(&path).unwrap(), before, "the file does not");
    }

    #[test]
    fn merged_sets_keep_their_buffers() {
        let a =
            TensorSet::from_tensors(vec![("b".to_string(), Dtype::U8, vec![1], vec![2])]).unwrap();
        let b = TensorSet::from_tensors(vec![
            ("a".to_string(), Dtype::U8, vec![1], vec![1]),
            ("c".to_string(), Dtype::U8, vec![2], vec![3, 4]),
        ])
        .unwrap();
        let digest = a.digest().wrapping_add(b.digest());
        let m = TensorSet::merge(vec![a.clone(), b.clone()]).unwrap();
        assert_eq!(
            m.tensors()
                .iter()
                .map(|t| t.name.as_str())
                .collect::<Vec<_>>(),
            ["a", "b", "c"]
        );
        assert_eq!(
            (m.data(0), m.data(1), m.data(2)),
            (&[1u8][..], &[2u8][..], &[3u8, 4][..])
        );
        assert!(m.has_digests());
        assert_eq!(m.digest(), digest);
        assert!(TensorSet::merge(vec![a.clone(), a]).is_err());
    }

    struct Lent(Vec<u8>, bool);

    impl ExternalBuffer for Lent {
        fn bytes(&self) -> &[u8] {
            &self.0
        }
        fn bytes_mut(&mut self) -> Option<&mut [u8]> {
            self.1.then_some(&mut self.0[..])
        }
    }

    #[test]
    fn external_buffers_are_used_in_place() {
        let mut set = TensorSet::from_external(vec![
            (
                "y".to_string(),
                Dtype::U8,
                vec![1],
                Box::new(Lent(vec![3], true)) as Box<dyn ExternalBuffer>,
            ),
            (
                "x".to_string(),
                Dtype::U16,
                vec![2],
                Box::new(Lent(vec![1, 2, 3, 4], true)),
            ),
        ])
        .unwrap();
        assert_eq!(set.tensors()[0].name, "x");
        assert_eq!(set.data(0), &[1, 2, 3, 4]);
        let mut parts = set.all_data_mut();
        parts[1][0] = 8;
        assert_eq!(set.data(1), &[8]);
        set.compute_digests();
        let owned = TensorSet::from_tensors(vec![
            ("x".to_string(), Dtype::U16, vec![2], vec![1, 2, 3, 4]),
            ("y".to_string(), Dtype::U8, vec![1], vec![8]),
        ])
        .unwrap();
        assert_eq!(set.digest(), owned.digest());
        // Sizes are checked against dtype and shape.
        assert!(
            TensorSet::from_external(vec![(
                "z".to_string(),
                Dtype::U16,
                vec![3],
                Box::new(Lent(vec![0; 4], false)) as Box<dyn ExternalBuffer>,
            )])
            .is_err()
        );
    }
}
