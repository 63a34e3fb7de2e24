//! Delta encoding: two tensor sets diffed and encoded as a delta object
//! (`compact` or `trl`), with the new set's digests derived from the base's.

use std::collections::BTreeMap;

use rayon::prelude::*;
use serde::Serialize;

use super::compact::{self, Context, TensorContext};
use super::trl;
use crate::digest::Digest;
use crate::dtype::{Dtype, key_kind, word_bytes};
use crate::error::{Error, Result};
use crate::format::{
    BlockEntry, ContextRef, Encoding, Header, Kind, TensorEntry, TrlOptions, keys,
};
use crate::tensors::{TensorSet, write_safetensors};

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
    /// `compact2`: the tensor's context for the next delta.
    next: Option<TensorContext>,
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
    encode_delta_ctx(base, new, opts, None).map(|(bytes, summary, _)| (bytes, summary))
}

/// [`encode_delta`] against a context (`compact2` only; docs/format.md
/// §6.3): `context` holds the changes of the delta that produced `base`
/// (what [`encode_delta_ctx`] returned for it), or `None` (after an anchor:
/// the delta is made without context and every reader decodes it). Returns
/// also the context for the next delta: `new`'s changes, for `compact2`;
/// `None` for other encodings.
///
/// Fails with [`Error::WrongContext`] when `context` does not lead to
/// `base` (its `id.to` is not `base`'s digest).
pub fn encode_delta_ctx(
    base: &TensorSet,
    new: &mut TensorSet,
    opts: &DeltaOptions,
    context: Option<&Context>,
) -> Result<(Vec<u8>, DeltaSummary, Option<Context>)> {
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
    let context = if opts.encoding == Encoding::Compact2 {
        context
    } else {
        None
    };
    if let Some(c) = context
        && c.id.to != base.digest()
    {
        return Err(Error::WrongContext {
            expected: format!("the changes that led to {}", base.digest()),
            actual: format!(
                "the changes of version {} (from {} to {})",
                c.id.version, c.id.from, c.id.to
            ),
        });
    }
    if let Some((name, t)) = context.and_then(|c| {
        c.tensors
            .iter()
            .find(|(_, t)| t.block_words != compact::BLOCK_WORDS && !t.is_empty())
    }) {
        return Err(Error::WrongContext {
            expected: format!("blocks of {} words", compact::BLOCK_WORDS),
            actual: format!("tensor `{name}` in blocks of {} words", t.block_words),
        });
    }
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
                        next: None,
                    })
                }
                Encoding::Compact2 => {
                    let tctx = context.and_then(|c| c.tensors.get(&t.name));
                    let e =
                        compact::v2::encode_tensor(key_kind(t.dtype), wb, t.seed, (old, nw), tctx);
                    Ok(TensorOut {
                        idx,
                        changed: e.tensor.changed,
                        digest_change: e.tensor.digest_change,
                        payload: vec![(
                            format!("{}{}", t.name, compact::SUFFIX),
                            Dtype::U8,
                            vec![e.tensor.payload.len()],
                            e.tensor.payload,
                        )],
                        blocks: Some(e.tensor.blocks),
                        next: Some(e.next),
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
                        next: None,
                    })
                }
            }
        })
        .collect::<Result<_>>()?;

    let mut entries = BTreeMap::new();
    let mut payload = Vec::new();
    let mut next_tensors = BTreeMap::new();
    let (mut changed, mut total) = (0u64, 0u64);
    for mut o in outs {
        let t = &base.tensors()[o.idx];
        let words = t.words() as u64;
        total += words;
        let digest = t.digest.wrapping_add(Digest(o.digest_change));
        new.set_digest(o.idx, digest);
        if o.changed == 0 {
            continue;
        }
        if let Some(next) = o.next.take() {
            next_tensors.insert(t.name.clone(), next);
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
        context: context.map(|c| ContextRef {
            version: c.id.version,
            base_digest: c.id.from,
            checksum: c.id.checksum,
        }),
    };
    let mut meta = header.to_metadata();
    meta.insert(keys::METADATA.into(), trainer_metadata_json(new.metadata()));
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
    let next = (opts.encoding == Encoding::Compact2).then(|| {
        Context::new(
            opts.model_version,
            (base.digest(), header.digest),
            next_tensors,
        )
    });
    Ok((out, summary, next))
}

/// The new file's `__metadata__` as a delta carries it ([`keys::METADATA`]):
/// what a `full` anchor of the version would carry, less weightcast's keys —
/// the file's own keys, and `format=pt` (which wins, as in the anchor, so
/// that Hugging Face loaders accept the output).
fn trainer_metadata_json(meta: &BTreeMap<String, String>) -> String {
    let mut own: BTreeMap<&str, &str> = meta
        .iter()
        .filter(|(k, _)| !k.starts_with("weightcast."))
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    own.insert("format", "pt");
    serde_json::to_string(&own).expect("a map of strings serializes")
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
