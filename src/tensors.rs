//! An in-memory set of named tensors laid out as one safetensors image.
//!
//! A [`TensorSet`] owns a single buffer (a whole safetensors file when it was
//! read from one) and describes each tensor as a byte range into it, so loading a
//! checkpoint costs one read and no copy, and applying a delta mutates the
//! tensors in place. Each tensor carries its additive [`Digest`], maintained
//! incrementally by the codec.

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
    /// Byte range of the data inside the set's buffer.
    pub range: Range<usize>,
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

/// Named tensors in one buffer, sorted by name.
#[derive(Clone, Debug)]
pub struct TensorSet {
    buf: Vec<u8>,
    tensors: Vec<TensorInfo>,
    index: HashMap<String, usize>,
    metadata: BTreeMap<String, String>,
    digests_valid: bool,
}

impl TensorSet {
    /// Parses a safetensors image, validating the container (header size, offsets,
    /// coverage, dtype/shape/length agreement) through the `safetensors` crate.
    pub fn from_safetensors(buf: Vec<u8>, digests: Digests) -> Result<Self> {
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
        let mut set = TensorSet::assemble(buf, tensors, metadata);
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
                digest: Digest::default(),
            });
        }
        Ok(TensorSet::assemble(buf, tensors, BTreeMap::new()))
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
                digest: Digest::default(),
            });
            total = end;
        }
        Ok(TensorSet::assemble(
            vec![0u8; total],
            tensors,
            BTreeMap::new(),
        ))
    }

    fn assemble(
        buf: Vec<u8>,
        tensors: Vec<TensorInfo>,
        metadata: BTreeMap<String, String>,
    ) -> Self {
        let index = tensors
            .iter()
            .enumerate()
            .map(|(i, t)| (t.name.clone(), i))
            .collect();
        TensorSet {
            buf,
            tensors,
            index,
            metadata,
            digests_valid: false,
        }
    }

    /// Every tensor's digest of its current bytes (a full pass, parallel),
    /// in tensor order.
    pub fn full_digests(&self) -> Vec<Digest> {
        self.tensors
            .par_iter()
            .map(|t| tensor_digest(t.seed, t.dtype, &self.buf[t.range.clone()]))
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
        &self.buf[self.tensors[i].range.clone()]
    }

    /// Mutable bytes of tensor `i`. Callers that change bytes are responsible for
    /// keeping the digest right (the codec does); others should call
    /// [`TensorSet::compute_digests`] afterwards.
    pub fn data_mut(&mut self, i: usize) -> &mut [u8] {
        let r = self.tensors[i].range.clone();
        &mut self.buf[r]
    }

    /// Mutable bytes of every tensor at once, in the order of [`TensorSet::tensors`].
    pub fn all_data_mut(&mut self) -> Vec<&mut [u8]> {
        // Ranges are disjoint; walk them in buffer order and split.
        let mut order: Vec<usize> = (0..self.tensors.len()).collect();
        // Empty tensors may share their start with the next tensor: order by end too.
        order.sort_by_key(|&i| (self.tensors[i].range.start, self.tensors[i].range.end));
        let mut out: Vec<Option<&mut [u8]>> = (0..self.tensors.len()).map(|_| None).collect();
        let mut rest: &mut [u8] = &mut self.buf;
        let mut consumed = 0usize;
        for i in order {
            let r = self.tensors[i].range.clone();
            let tail = std::mem::take(&mut rest);
            let (_, tail) = tail.split_at_mut(r.start - consumed);
            let (mine, tail) = tail.split_at_mut(r.len());
            out[i] = Some(mine);
            rest = tail;
            consumed = r.end;
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
                    &self.buf[t.range.clone()],
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
}
