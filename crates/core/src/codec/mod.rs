//! Diff, encode, decode and apply: turning two [`TensorSet`]s into a delta
//! object and a delta object back into exact bytes, plus anchors.
//!
//! Applies are all-or-nothing per object. [`apply_delta`] patches a
//! [`TensorSet`] in one pass and undoes every word it wrote if anything fails
//! to decode or verify; [`apply_in_place`] patches buffers the caller owns,
//! verifying every tensor before writing any; [`Delta`] serves tensors that
//! live elsewhere (positions out, old words in, new words out). All of them
//! run the same decoders (see `apply/`).

pub mod anchor;
mod apply;
pub mod bits;
pub mod compact;
pub mod cpu;
mod parse;
pub mod planes;
pub mod scan;
pub mod trl;
pub mod vector;

pub use crate::digest::tensor_digest_of;
pub use anchor::{AnchorObject, decode_anchor, read_anchor};
pub use apply::{
    Delta, InPlaceOptions, InPlaceReport, Positions, Prepared, Target, TensorChange,
    apply_in_place, apply_in_place_all, apply_in_place_with, prepare_in_place_all,
};

use std::collections::BTreeMap;
use std::io::Write;

use rayon::prelude::*;
use safetensors::SafeTensors;
use serde::Serialize;

use crate::digest::Digest;
use crate::dtype::{Dtype, element_count, key_kind, word_bytes};
use crate::error::{Error, Result};
use crate::format::{BlockEntry, Encoding, Header, Kind, TensorEntry, TrlOptions, keys};
use crate::tensors::{TensorSet, safetensors_header, safetensors_header_lens, write_safetensors};
use parse::{Local, check_payload, foreign_trl_jobs, weightcast_jobs};

/// What a delta is and where it sits in the version chain.
///
/// Build one with [`DeltaOptions::new`] or with the fields and
/// `..Default::default()` (compact, version 1 from 0, TRL v3 `gap_delta`).
#[derive(Clone, Copy, Debug)]
pub struct DeltaOptions {
    /// Delta encoding (`compact` or `trl`).
    pub encoding: Encoding,
    /// Version the delta produces.
    pub model_version: u64,
    /// Version the delta applies to.
    pub base_version: u64,
    /// For `trl`: which TRL generation (and v3 index encoding) to write.
    pub trl: TrlOptions,
}

impl DeltaOptions {
    /// A delta from `base_version` to `model_version`, TRL options at their default.
    pub fn new(encoding: Encoding, model_version: u64, base_version: u64) -> DeltaOptions {
        DeltaOptions {
            encoding,
            model_version,
            base_version,
            trl: TrlOptions::default(),
        }
    }
}

impl Default for DeltaOptions {
    fn default() -> DeltaOptions {
        DeltaOptions::new(Encoding::Compact, 1, 0)
    }
}

/// Figures about an encoded delta.
#[derive(Clone, Debug, Serialize)]
pub struct DeltaSummary {
    /// Version produced.
    pub model_version: u64,
    /// Version applied to.
    pub base_version: u64,
    /// Encoding used.
    pub encoding: Encoding,
    /// Changed words.
    pub changed: u64,
    /// All words of the file state.
    pub total: u64,
    /// Tensors with at least one change.
    pub changed_tensors: usize,
    /// Size of the delta object in bytes.
    pub bytes: u64,
    /// Digest of the new file state.
    pub digest: String,
}

struct TensorOut {
    idx: usize,
    changed: u64,
    digest_change: u64,
    blocks: Option<Vec<BlockEntry>>,
    payload: Vec<(String, Dtype, Vec<usize>, Vec<u8>)>,
}

/// Diffs `new` against `base` and encodes the delta object. Also records `new`'s
/// digests, derived incrementally from `base`'s (so no full pass over `new`).
///
/// Fails with [`Error::StructureChanged`] when the two sets differ in names,
/// dtypes or shapes: that version must be published as an anchor.
pub fn encode_delta(
    base: &TensorSet,
    new: &mut TensorSet,
    opts: &DeltaOptions,
) -> Result<(Vec<u8>, DeltaSummary)> {
    if !base.has_digests() {
        return Err(Error::metadata("base", "base tensor set has no digests"));
    }
    if matches!(opts.encoding, Encoding::Full | Encoding::Planes) {
        return Err(Error::metadata(
            keys::ENCODING,
            format!(
                "`{}` is an anchor encoding, not a delta encoding",
                opts.encoding
            ),
        ));
    }
    base.same_structure(new)?;
    let outs: Vec<TensorOut> = base
        .tensors()
        .par_iter()
        .enumerate()
        .map(|(idx, t)| -> Result<TensorOut> {
            let wb = word_bytes(t.dtype);
            let (old, nw) = (base.data(idx), new.data(idx));
            match opts.encoding {
                Encoding::Compact => {
                    let e = compact::encode_tensor(key_kind(t.dtype), wb, t.seed, old, nw);
                    Ok(TensorOut {
                        idx,
                        changed: e.changed,
                        digest_change: e.digest_change,
                        payload: vec![(
                            format!("{}{}", t.name, compact::SUFFIX),
                            Dtype::U8,
                            vec![e.payload.len()],
                            e.payload,
                        )],
                        blocks: Some(e.blocks),
                    })
                }
                _ => {
                    trl::check_representable(&t.name, t.dtype, t.words())?;
                    let e = trl::encode_tensor(wb, t.seed, old, nw);
                    Ok(TensorOut {
                        idx,
                        changed: e.changed,
                        digest_change: e.digest_change,
                        payload: trl::payload_tensors(&t.name, t.dtype, e, &opts.trl)?,
                        blocks: None,
                    })
                }
            }
        })
        .collect::<Result<_>>()?;

    let mut entries = BTreeMap::new();
    let mut payload = Vec::new();
    let (mut changed, mut total) = (0u64, 0u64);
    for o in outs {
        let t = &base.tensors()[o.idx];
        let words = t.words() as u64;
        total += words;
        let digest = t.digest.wrapping_add(Digest(o.digest_change));
        new.set_digest(o.idx, digest);
        if o.changed == 0 {
            continue;
        }
        changed += o.changed;
        entries.insert(
            t.name.clone(),
            TensorEntry {
                dtype: t.dtype.to_string(),
                shape: t.shape.iter().map(|&d| d as u64).collect(),
                elements: t.elements(),
                changed: o.changed,
                density: o.changed as f64 / words as f64,
                digest: digest.to_string(),
                base_digest: Some(t.digest.to_string()),
                block_words: o.blocks.as_ref().map(|_| compact::BLOCK_WORDS),
                blocks: o.blocks,
            },
        );
        payload.extend(o.payload);
    }
    new.mark_digests_valid();
    payload.sort_by(|a, b| a.0.cmp(&b.0));

    let mut hasher = blake3::Hasher::new();
    for p in &payload {
        hasher.update(&p.3);
    }
    let header = Header {
        kind: Kind::Delta,
        encoding: opts.encoding,
        model_version: opts.model_version,
        base_version: Some(opts.base_version),
        base_digest: Some(base.digest()),
        digest: new.digest(),
        tensor_count: base.len() as u64,
        total_elements: base.total_elements(),
        changed_elements: changed,
        density: if total == 0 {
            0.0
        } else {
            changed as f64 / total as f64
        },
        payload_blake3: Some(hasher.finalize().to_hex().to_string()),
        tensors: entries,
    };
    let mut meta = header.to_metadata();
    if opts.encoding == Encoding::Trl {
        add_trl_keys(&mut meta, &header, &opts.trl);
    }
    let views: Vec<(&str, Dtype, &[usize], &[u8])> = payload
        .iter()
        .map(|(n, d, s, b)| (n.as_str(), *d, s.as_slice(), b.as_slice()))
        .collect();
    let mut out = Vec::new();
    write_safetensors(&views, &meta, &mut out)?;
    let summary = DeltaSummary {
        model_version: opts.model_version,
        base_version: opts.base_version,
        encoding: opts.encoding,
        changed,
        total,
        changed_tensors: header.tensors.len(),
        bytes: out.len() as u64,
        digest: header.digest.to_string(),
    };
    Ok((out, summary))
}

/// The TRL `sparse_weight_patch` keys of the generation `trl` names (see
/// docs/format.md §6.2 for how `total_elements` and `sparsity` relate to TRL's
/// own writer).
fn add_trl_keys(meta: &mut BTreeMap<String, String>, h: &Header, opts: &TrlOptions) {
    let names: Vec<&str> = h.tensors.keys().map(String::as_str).collect();
    trl::delta_keys(
        meta,
        h.model_version,
        &names,
        h.changed_elements,
        h.total_elements,
        opts,
    );
}

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
            (weightcast_jobs(&h, &st, local)?, Some(h))
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
    let (changed, new_digests) =
        apply::apply_jobs(state, &jobs, header.as_ref().map(|h| h.digest))?;
    for (j, d) in jobs.iter().zip(new_digests) {
        state.set_digest(j.idx, d);
    }
    let encoding = header.as_ref().map_or(Encoding::Trl, |h| h.encoding);
    Ok(ApplyReport {
        model_version: header
            .as_ref()
            .map(|h| h.model_version)
            .or_else(|| map.get("model_version").and_then(|v| v.parse().ok())),
        base_version: header.as_ref().and_then(|h| h.base_version),
        encoding,
        changed,
        changed_tensors: jobs.iter().map(|j| j.name.clone()).collect(),
        verified: header.is_some(),
    })
}

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

fn anchor_header(set: &TensorSet, model_version: u64) -> Header {
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
    }
}

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

/// [`write_anchor`] into a new vector.
pub fn encode_anchor(set: &TensorSet, model_version: u64) -> Result<(Vec<u8>, AnchorSummary)> {
    let mut out = Vec::with_capacity(set.total_bytes() as usize + 4096);
    let s = write_anchor(set, model_version, &mut out)?;
    Ok((out, s))
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

/// Writes the plain (`full`) anchor that an anchor object stands for into
/// `w`: a `planes` anchor decoded (bounded memory, every digest checked), a
/// `full` anchor or plain checkpoint copied as is. Returns the bytes written.
pub fn materialize_anchor(object: &[u8], w: &mut impl Write) -> Result<u64> {
    let (_, header) = inspect(object)?;
    if header.as_ref().is_some_and(planes::is_planes) {
        return planes::materialize(object, w);
    }
    w.write_all(object)
        .map_err(|e| Error::io("writing the materialized anchor", e))?;
    Ok(object.len() as u64)
}

/// Whether a header entry describes a tensor of this dtype and shape (the
/// element count too).
fn entry_matches(e: &TensorEntry, dtype: Dtype, shape: &[usize]) -> bool {
    e.dtype == dtype.to_string()
        && e.shape.len() == shape.len()
        && e.shape.iter().zip(shape).all(|(&a, &b)| a == b as u64)
        && e.elements == element_count(shape).unwrap_or(0)
}

/// Validates the container and returns the header length and `__metadata__`.
fn metadata_map(bytes: &[u8]) -> Result<(usize, BTreeMap<String, String>)> {
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

/// Reads just the header of an anchor or delta object. For a `planes` anchor
/// it also validates the chunk table (see [`planes::PlanesLayout::parse`]).
pub fn inspect(bytes: &[u8]) -> Result<(BTreeMap<String, String>, Option<Header>)> {
    let (_, map) = metadata_map(bytes)?;
    let h = Header::from_metadata(&map)?;
    if h.as_ref().is_some_and(planes::is_planes) {
        planes::PlanesLayout::parse(bytes)?;
    }
    Ok((map, h))
}
