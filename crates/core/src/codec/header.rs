//! What the header of every object is made of: an anchor's header from its
//! tensors, the safetensors prefix, the trainer's metadata carried along, the
//! container's metadata read back, and a header entry matched against a
//! tensor. Shared by every writer and reader of objects (`anchor`, `planes`,
//! `trl`, `parse`).

use std::collections::BTreeMap;

use safetensors::SafeTensors;
use serde::Serialize;

use crate::digest::Digest;
use crate::dtype::{Dtype, element_count};
use crate::error::{Error, Result};
use crate::format::{Encoding, Header, Kind, TensorEntry};
use crate::tensors::{TensorSet, safetensors_header_lens};

/// Figures about an anchor.
#[derive(Clone, Debug, Serialize)]
pub struct AnchorSummary {
    /// Version.
    pub model_version: u64,
    /// Tensors.
    pub tensors: usize,
    /// Elements.
    pub total: u64,
    /// Object size in bytes.
    pub bytes: u64,
    /// Digest of the file state.
    pub digest: String,
}

/// The header of an anchor holding `set` (`encoding = full`).
pub(crate) fn anchor_header(set: &TensorSet, model_version: u64) -> Header {
    let items = set.tensors().iter().map(|t| {
        (
            t.name.as_str(),
            t.dtype,
            t.shape.as_slice(),
            t.words() as u64,
            t.digest,
        )
    });
    anchor_header_of(items, model_version, Encoding::Full)
}

/// The header of an anchor holding these tensors (name, dtype, shape, words,
/// digest); the same for every anchor encoding but `encoding` itself.
pub(crate) fn anchor_header_of<'a>(
    items: impl IntoIterator<Item = (&'a str, Dtype, &'a [usize], u64, Digest)>,
    model_version: u64,
    encoding: Encoding,
) -> Header {
    let (mut words, mut elements, mut digest) = (0u64, 0u64, Digest::default());
    let tensors = items
        .into_iter()
        .map(|(name, dtype, shape, w, d)| {
            let e = element_count(shape).unwrap_or(0);
            words += w;
            elements += e;
            digest = digest.wrapping_add(d);
            (
                name.to_string(),
                TensorEntry {
                    dtype: dtype.to_string(),
                    shape: shape.iter().map(|&d| d as u64).collect(),
                    elements: e,
                    changed: w,
                    density: 1.0,
                    digest: d.to_string(),
                    base_digest: None,
                    block_words: None,
                    blocks: None,
                },
            )
        })
        .collect::<BTreeMap<_, _>>();
    Header {
        kind: Kind::Anchor,
        encoding,
        model_version,
        base_version: None,
        base_digest: None,
        digest,
        tensor_count: tensors.len() as u64,
        total_elements: elements,
        changed_elements: words,
        density: 1.0,
        payload_blake3: None,
        tensors,
        context: None,
    }
}

/// Carries a checkpoint's own header metadata (the trainer's `__metadata__`,
/// e.g. `format`, or keys of its own) into an anchor beside weightcast's keys,
/// so a subscriber's output keeps it. `weightcast.*` keys of the source are
/// dropped (an anchor says what it is itself), and weightcast's keys win.
pub fn keep_trainer_metadata(
    meta: &mut BTreeMap<String, String>,
    source: &BTreeMap<String, String>,
) {
    for (k, v) in source {
        if !k.starts_with("weightcast.") {
            meta.entry(k.clone()).or_insert_with(|| v.clone());
        }
    }
}

/// An object's first bytes: the 8-byte header length and the padded header
/// of tensors with these byte lengths, in this order.
pub(crate) fn object_prefix(
    lens: &[(&str, Dtype, &[usize], usize)],
    meta: &BTreeMap<String, String>,
) -> Result<Vec<u8>> {
    let head = safetensors_header_lens(lens, meta)?;
    let mut out = Vec::with_capacity(8 + head.len());
    out.extend_from_slice(&(head.len() as u64).to_le_bytes());
    out.extend_from_slice(&head);
    Ok(out)
}

/// Whether a header entry describes a tensor of this dtype and shape (the
/// element count too).
pub(crate) fn entry_matches(e: &TensorEntry, dtype: Dtype, shape: &[usize]) -> bool {
    e.dtype == dtype.to_string()
        && e.shape.len() == shape.len()
        && e.shape.iter().zip(shape).all(|(&a, &b)| a == b as u64)
        && e.elements == element_count(shape).unwrap_or(0)
}

/// Validates the container and returns the header length and `__metadata__`.
pub(crate) fn metadata_map(bytes: &[u8]) -> Result<(usize, BTreeMap<String, String>)> {
    let (n, meta) =
        SafeTensors::read_metadata(bytes).map_err(|e| Error::Container(e.to_string()))?;
    let map = meta
        .metadata()
        .clone()
        .unwrap_or_default()
        .into_iter()
        .collect();
    Ok((n, map))
}
