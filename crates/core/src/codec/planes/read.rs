//! Reading a `planes` anchor: chunks, tensors and whole objects decoded and
//! checked against the header's digests, from the whole object or from
//! windows of it ([`PlanesDecoder`]), or materialized as the raw anchor.

use std::io::Write;

use rayon::prelude::*;

use crate::digest::{Digest, words_digest};
use crate::dtype::word_bytes;
use crate::error::{Error, Result};

use super::kernels::decode_chunk_local;
use super::layout::{PlanesLayout, is_planes, prefix_len};
use crate::codec::header::metadata_map;
use crate::format::Header;

impl PlanesLayout {
    /// Decodes chunk `c` of tensor `t` from `src` (exactly its stored bytes)
    /// into `dst` (exactly its decoded bytes) and returns its digest
    /// contribution (the tensor's digest is the sum over its chunks).
    pub fn decode_chunk(&self, t: usize, c: usize, src: &[u8], dst: &mut [u8]) -> Result<Digest> {
        self.decode_chunk_as(t, c, src, dst, true)
    }

    fn decode_chunk_as(
        &self,
        t: usize,
        c: usize,
        src: &[u8],
        dst: &mut [u8],
        digest: bool,
    ) -> Result<Digest> {
        let tensor = &self.tensors[t];
        let chunk = &tensor.chunks[c];
        let wb = word_bytes(tensor.dtype);
        if src.len() as u64 != chunk.stored.end - chunk.stored.start
            || dst.len() as u64 != chunk.decoded.end - chunk.decoded.start
        {
            return Err(Error::tensor(
                &tensor.name,
                format!(
                    "chunk {c}: {} stored and {} decoded bytes given, {:?} and {:?} expected",
                    src.len(),
                    dst.len(),
                    chunk.stored,
                    chunk.decoded
                ),
            ));
        }
        decode_chunk_local(&tensor.name, c, wb, &chunk.planes, src, dst)?;
        if !digest {
            return Ok(Digest::default());
        }
        Ok(words_digest(
            tensor.seed,
            tensor.dtype,
            dst,
            chunk.decoded.start / wb as u64,
        ))
    }

    /// Decodes tensor `t` from the whole object into `dst` (its decoded bytes),
    /// chunks in parallel, and checks its digest.
    pub fn decode_tensor(&self, t: usize, object: &[u8], dst: &mut [u8]) -> Result<()> {
        self.decode_tensor_as(t, object, dst, true)
    }

    fn decode_tensor_as(
        &self,
        t: usize,
        object: &[u8],
        dst: &mut [u8],
        verify: bool,
    ) -> Result<()> {
        let tensor = &self.tensors[t];
        self.check_object(object)?;
        if dst.len() as u64 != tensor.decoded.end - tensor.decoded.start {
            return Err(Error::tensor(
                &tensor.name,
                format!(
                    "{} bytes given for {} decoded bytes",
                    dst.len(),
                    tensor.decoded.end - tensor.decoded.start
                ),
            ));
        }
        let chunk = self.chunk_words as usize * word_bytes(tensor.dtype);
        let sum = dst
            .par_chunks_mut(chunk.max(1))
            .enumerate()
            .map(|(c, d)| {
                let r = &tensor.chunks[c].stored;
                self.decode_chunk_as(t, c, &object[r.start as usize..r.end as usize], d, verify)
            })
            .try_reduce(Digest::default, |a, b| Ok(a.wrapping_add(b)))?;
        if !verify {
            return Ok(());
        }
        self.check_tensor(t, sum)
    }

    fn check_object(&self, object: &[u8]) -> Result<()> {
        if object.len() as u64 != self.object_len {
            return Err(Error::Container(format!(
                "object has {} bytes, its header describes {}",
                object.len(),
                self.object_len
            )));
        }
        Ok(())
    }

    fn check_tensor(&self, t: usize, got: Digest) -> Result<()> {
        let tensor = &self.tensors[t];
        if got != tensor.digest {
            return Err(Error::Integrity {
                scope: format!("tensor {}", tensor.name),
                expected: tensor.digest.to_string(),
                actual: got.to_string(),
            });
        }
        Ok(())
    }

    fn check_file(&self) -> Result<()> {
        let sum = self
            .tensors
            .iter()
            .fold(Digest::default(), |a, t| a.wrapping_add(t.digest));
        if sum != self.header.digest {
            return Err(Error::Integrity {
                scope: "file".into(),
                expected: self.header.digest.to_string(),
                actual: sum.to_string(),
            });
        }
        Ok(())
    }

    /// Decodes the whole object into the materialized anchor's data section
    /// (`data`, [`Self::decoded_len`] bytes), tensors and chunks in parallel,
    /// and checks every digest.
    pub fn decode_all(&self, object: &[u8], data: &mut [u8]) -> Result<()> {
        self.decode_all_as(object, data, true)
    }

    /// [`Self::decode_all`] without the digests (benchmarks: the decode alone).
    pub(crate) fn decode_all_as(&self, object: &[u8], data: &mut [u8], verify: bool) -> Result<()> {
        self.check_object(object)?;
        if data.len() as u64 != self.decoded_len() {
            return Err(Error::Container(format!(
                "{} bytes given for {} decoded bytes",
                data.len(),
                self.decoded_len()
            )));
        }
        let mut parts = Vec::with_capacity(self.tensors.len());
        let mut rest = data;
        for t in &self.tensors {
            let (mine, tail) = rest.split_at_mut((t.decoded.end - t.decoded.start) as usize);
            parts.push(mine);
            rest = tail;
        }
        parts
            .into_par_iter()
            .enumerate()
            .try_for_each(|(t, d)| self.decode_tensor_as(t, object, d, verify))?;
        if !verify {
            return Ok(());
        }
        self.check_file()
    }
}

/// The raw anchor a `planes` object stands for (every digest checked), or
/// `None` when `object` is not a `planes` anchor.
pub fn decode_object_if_planes(object: &[u8]) -> Result<Option<Vec<u8>>> {
    let (_, map) = metadata_map(object)?;
    if !Header::from_metadata(&map)?.as_ref().is_some_and(is_planes) {
        return Ok(None);
    }
    let layout = PlanesLayout::parse(&object[..prefix_len(object)? as usize])?;
    let mut out = layout.raw_prefix()?;
    let at = out.len();
    out.resize(at + layout.decoded_len() as usize, 0);
    layout.decode_all(object, &mut out[at..])?;
    Ok(Some(out))
}

/// Decodes a `planes` anchor from windows of its bytes (ranged reads, any
/// order) into the materialized anchor's data section, and checks the digests
/// once every chunk is in.
pub struct PlanesDecoder<'a> {
    layout: &'a PlanesLayout,
    /// Per tensor: digest contributions so far and chunks decoded.
    sums: Vec<(Digest, Vec<bool>)>,
    /// Tensor indices by stored offset.
    by_stored: Vec<usize>,
}

impl<'a> PlanesDecoder<'a> {
    /// A decoder for `layout`'s object.
    pub fn new(layout: &'a PlanesLayout) -> Self {
        let mut by_stored: Vec<usize> = (0..layout.tensors.len()).collect();
        by_stored.sort_by_key(|&t| layout.tensors[t].stored.start);
        PlanesDecoder {
            layout,
            sums: layout
                .tensors
                .iter()
                .map(|t| (Digest::default(), vec![false; t.chunks.len()]))
                .collect(),
            by_stored,
        }
    }

    /// Decodes every chunk not decoded yet whose stored bytes lie wholly in
    /// `window` (the object's bytes from offset `start`) into `data` (the
    /// materialized data section, [`PlanesLayout::decoded_len`] bytes), in
    /// parallel. Returns how many chunks it decoded.
    pub fn feed(&mut self, start: u64, window: &[u8], data: &mut [u8]) -> Result<usize> {
        let layout = self.layout;
        if data.len() as u64 != layout.decoded_len() {
            return Err(Error::Container(format!(
                "{} bytes given for {} decoded bytes",
                data.len(),
                layout.decoded_len()
            )));
        }
        let end = start + window.len() as u64;
        // (absolute decoded start, tensor, chunk)
        let mut jobs: Vec<(u64, usize, usize)> = Vec::new();
        for &t in &self.by_stored {
            let tensor = &layout.tensors[t];
            if tensor.stored.end <= start || tensor.stored.start >= end {
                continue;
            }
            let from = tensor.chunks.partition_point(|c| c.stored.start < start);
            for (c, chunk) in tensor.chunks.iter().enumerate().skip(from) {
                if chunk.stored.end > end {
                    break;
                }
                if !self.sums[t].1[c] {
                    jobs.push((tensor.decoded.start + chunk.decoded.start, t, c));
                }
            }
        }
        jobs.sort_unstable();
        // Disjoint destination slices, in decoded order.
        let mut work: Vec<(usize, usize, &mut [u8])> = Vec::with_capacity(jobs.len());
        let (mut rest, mut consumed): (&mut [u8], u64) = (data, 0);
        for &(at, t, c) in &jobs {
            let r = &layout.tensors[t].chunks[c].decoded;
            let tail = std::mem::take(&mut rest);
            let (_, tail) = tail.split_at_mut((at - consumed) as usize);
            let (mine, tail) = tail.split_at_mut((r.end - r.start) as usize);
            work.push((t, c, mine));
            rest = tail;
            consumed = at + (r.end - r.start);
        }
        let results: Vec<(usize, usize, Digest)> = work
            .into_par_iter()
            .map(|(t, c, dst)| {
                let s = &layout.tensors[t].chunks[c].stored;
                let src = &window[(s.start - start) as usize..(s.end - start) as usize];
                layout.decode_chunk(t, c, src, dst).map(|d| (t, c, d))
            })
            .collect::<Result<_>>()?;
        let n = results.len();
        for (t, c, d) in results {
            let s = &mut self.sums[t];
            s.0 = s.0.wrapping_add(d);
            s.1[c] = true;
        }
        Ok(n)
    }

    /// Whether every chunk has been decoded.
    pub fn complete(&self) -> bool {
        self.sums.iter().all(|(_, done)| done.iter().all(|&d| d))
    }

    /// Checks that every chunk was decoded and that every tensor and the file
    /// have the header's digests; returns the tensors' digests in layout order.
    pub fn finish(self) -> Result<Vec<Digest>> {
        for (t, (sum, done)) in self.sums.iter().enumerate() {
            if let Some(c) = done.iter().position(|&d| !d) {
                return Err(Error::tensor(
                    &self.layout.tensors[t].name,
                    format!("chunk {c} was never decoded (no window held all of it)"),
                ));
            }
            self.layout.check_tensor(t, *sum)?;
        }
        self.layout.check_file()?;
        Ok(self.sums.into_iter().map(|(d, _)| d).collect())
    }
}

/// Writes the plain (`full`) anchor that the `planes` object `object` stands
/// for into `w`, decoding a bounded batch of chunks at a time and checking
/// every digest; returns the bytes written. On an error, what was written is
/// incomplete and must be discarded.
pub fn materialize(object: &[u8], w: &mut impl Write) -> Result<u64> {
    let layout = PlanesLayout::parse(object)?;
    layout.check_object(object)?;
    let io = |e| Error::io("writing the materialized anchor", e);
    let prefix = layout.raw_prefix()?;
    w.write_all(&prefix).map_err(io)?;
    let mut buf = Vec::new();
    let batch = (16usize << 20).max(rayon::current_num_threads());
    for (t, tensor) in layout.tensors.iter().enumerate() {
        let chunk = (layout.chunk_words as usize * word_bytes(tensor.dtype)).max(1);
        let per = (batch / chunk).max(rayon::current_num_threads()).max(1);
        let mut sum = Digest::default();
        for (g, group) in tensor.chunks.chunks(per).enumerate() {
            let len: u64 = group.iter().map(|c| c.decoded.end - c.decoded.start).sum();
            buf.resize(len as usize, 0);
            let first = g * per;
            let d = buf
                .par_chunks_mut(chunk)
                .zip(group.par_iter())
                .enumerate()
                .map(|(i, (dst, c))| {
                    let src = &object[c.stored.start as usize..c.stored.end as usize];
                    layout.decode_chunk(t, first + i, src, dst)
                })
                .try_reduce(Digest::default, |a, b| Ok(a.wrapping_add(b)))?;
            sum = sum.wrapping_add(d);
            w.write_all(&buf).map_err(io)?;
        }
        layout.check_tensor(t, sum)?;
    }
    layout.check_file()?;
    Ok(prefix.len() as u64 + layout.decoded_len())
}

/// Decodes a whole `planes` object into the materialized anchor's bytes
/// (prefix and data), every digest checked; returns them with the layout and
/// the tensors' digests.
pub(crate) fn decode_object(object: &[u8]) -> Result<(PlanesLayout, Vec<u8>)> {
    let layout = PlanesLayout::parse(object)?;
    layout.check_object(object)?;
    let prefix = layout.raw_prefix()?;
    let total = (prefix.len() as u64)
        .checked_add(layout.decoded_len())
        .and_then(|t| usize::try_from(t).ok())
        .ok_or_else(|| Error::Container("decoded anchor does not fit in memory".into()))?;
    let mut out = Vec::new();
    out.try_reserve_exact(total).map_err(|_| {
        Error::Container(format!(
            "cannot allocate {total} bytes for the decoded anchor"
        ))
    })?;
    out.extend_from_slice(&prefix);
    out.resize(total, 0);
    layout.decode_all(object, &mut out[prefix.len()..])?;
    Ok((layout, out))
}
