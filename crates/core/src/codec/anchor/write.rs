//! Writing anchor objects: raw (`full`, a loadable safetensors checkpoint)
//! or compressed (`planes`), streamed or into memory.

use std::io::Write;

use crate::codec::header::{AnchorSummary, anchor_header, keep_trainer_metadata, object_prefix};
use crate::codec::planes;
use crate::dtype::Dtype;
use crate::error::{Error, Result};
use crate::tensors::{TensorSet, safetensors_header, write_safetensors};

/// Streams `set` as an anchor object (a loadable safetensors checkpoint with
/// `format=pt` and the weightcast header) into `w`.
pub fn write_anchor(
    set: &TensorSet,
    model_version: u64,
    w: &mut impl Write,
) -> Result<AnchorSummary> {
    if !set.has_digests() {
        return Err(Error::metadata("anchor", "tensor set has no digests"));
    }
    let header = anchor_header(set, model_version);
    let mut meta = header.to_metadata();
    keep_trainer_metadata(&mut meta, set.metadata());
    let views: Vec<(&str, Dtype, &[usize], &[u8])> = set
        .tensors()
        .iter()
        .enumerate()
        .map(|(i, t)| (t.name.as_str(), t.dtype, t.shape.as_slice(), set.data(i)))
        .collect();
    let head = safetensors_header(&views, &meta)?;
    write_safetensors(&views, &meta, w)?;
    Ok(AnchorSummary {
        model_version,
        tensors: set.len(),
        total: set.total_elements(),
        bytes: 8 + head.len() as u64 + set.total_bytes(),
        digest: header.digest.to_string(),
    })
}

/// The bytes [`write_anchor`] writes before the tensor data (the 8-byte length
/// and the padded JSON header). The data follows contiguously, tensors in the
/// order of [`TensorSet::tensors`]: tensor `i` starts at `prefix.len()` plus
/// the data lengths of the tensors before it.
pub fn anchor_prefix(set: &TensorSet, model_version: u64) -> Result<Vec<u8>> {
    if !set.has_digests() {
        return Err(Error::metadata("anchor", "tensor set has no digests"));
    }
    let mut meta = anchor_header(set, model_version).to_metadata();
    keep_trainer_metadata(&mut meta, set.metadata());
    let lens: Vec<(&str, Dtype, &[usize], usize)> = set
        .tensors()
        .iter()
        .map(|t| (t.name.as_str(), t.dtype, t.shape.as_slice(), t.range.len()))
        .collect();
    object_prefix(&lens, &meta)
}

/// [`write_anchor`] into a new vector.
pub fn encode_anchor(set: &TensorSet, model_version: u64) -> Result<(Vec<u8>, AnchorSummary)> {
    let mut out = Vec::with_capacity(set.total_bytes() as usize + 4096);
    let s = write_anchor(set, model_version, &mut out)?;
    Ok((out, s))
}

/// Length of the prefix [`write_anchor_planes`] returns for `set` with `opts`,
/// known before anything is compressed ([`planes::reserved_prefix_len`]).
pub fn planes_prefix_len(
    set: &TensorSet,
    model_version: u64,
    opts: &planes::PlanesOptions,
) -> Result<usize> {
    if !set.has_digests() {
        return Err(Error::metadata("anchor", "tensor set has no digests"));
    }
    let tensors: Vec<_> = set
        .tensors()
        .iter()
        .map(|t| (t.name.as_str(), t.dtype, t.shape.as_slice(), t.digest))
        .collect();
    planes::reserved_prefix_len(&tensors, opts, model_version, set.metadata())
}

/// Compresses `set` as a `planes` anchor (docs/format.md §5.1) whose chunks go
/// to `sink` (a spill file, or memory): the object is the returned prefix
/// followed by what was written to `sink`.
pub fn write_anchor_planes<W: Write>(
    set: &TensorSet,
    model_version: u64,
    opts: planes::PlanesOptions,
    sink: W,
) -> Result<planes::Finished<W>> {
    if !set.has_digests() {
        return Err(Error::metadata("anchor", "tensor set has no digests"));
    }
    let mut w = planes::PlanesWriter::new(sink, opts)?;
    w.set_metadata(set.metadata());
    for (i, t) in set.tensors().iter().enumerate() {
        w.tensor(&t.name, t.dtype, &t.shape, set.data(i))?;
    }
    let digests = set
        .tensors()
        .iter()
        .map(|t| (t.name.clone(), t.digest))
        .collect();
    w.finish(model_version, &digests)
}

/// Streams `set` as a `planes` anchor into `w`, spilling the compressed chunks
/// to an anonymous temporary file first (the header, which comes first, needs
/// their sizes).
pub fn write_anchor_compressed(
    set: &TensorSet,
    model_version: u64,
    w: &mut impl Write,
) -> Result<AnchorSummary> {
    let spill = tempfile::tempfile().map_err(|e| Error::io("creating a spill file", e))?;
    let spill = std::io::BufWriter::with_capacity(1 << 20, spill);
    let f = write_anchor_planes(set, model_version, planes::PlanesOptions::default(), spill)?;
    let io = |e| Error::io("writing the compressed anchor", e);
    let mut spill = f
        .sink
        .into_inner()
        .map_err(|e| Error::io("writing a spill file", e.into_error()))?;
    use std::io::Seek;
    spill
        .rewind()
        .map_err(|e| Error::io("rewinding a spill file", e))?;
    w.write_all(&f.prefix).map_err(io)?;
    let copied = std::io::copy(&mut spill, w).map_err(io)?;
    if copied != f.data_bytes {
        return Err(Error::Container(format!(
            "spill file holds {copied} bytes, {} were written",
            f.data_bytes
        )));
    }
    Ok(AnchorSummary {
        model_version,
        tensors: set.len(),
        total: set.total_elements(),
        bytes: f.prefix.len() as u64 + f.data_bytes,
        digest: f.header.digest.to_string(),
    })
}

/// [`write_anchor_compressed`] into a new vector (no spill file).
pub fn encode_anchor_compressed(
    set: &TensorSet,
    model_version: u64,
) -> Result<(Vec<u8>, AnchorSummary)> {
    let f = write_anchor_planes(
        set,
        model_version,
        planes::PlanesOptions::default(),
        Vec::new(),
    )?;
    let mut out = f.prefix;
    out.extend_from_slice(&f.sink);
    let summary = AnchorSummary {
        model_version,
        tensors: set.len(),
        total: set.total_elements(),
        bytes: out.len() as u64,
        digest: f.header.digest.to_string(),
    };
    Ok((out, summary))
}
