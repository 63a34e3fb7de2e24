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
/// `..Default::default()` (compact, version 1 from 0, TRL v3 `gap_delta`,
/// `compact2` up to [`COMPACT2_MAX_DENSITY`]).
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
    /// For `compact2`: the largest share of changed words (0 to 1) a delta
    /// is written in `compact2`; a denser one is written in `compact`, and
    /// leaves no context (the next delta is then made without one). The
    /// share is estimated before encoding, from a sample of the data
    /// ([`sampled_density`]). Above about 12% density `compact2`'s encode
    /// and apply fall under 0.8 of `compact`'s throughput, while its payload
    /// stays 1.1–1.2x smaller (docs/benchmarks.md): 1.0 keeps `compact2` at
    /// every density, for links where the bytes cost more than the cores.
    /// Default: [`COMPACT2_MAX_DENSITY`].
    pub compact2_max_density: f64,
}

/// [`DeltaOptions::compact2_max_density`]'s default: 10% of the words
/// changed.
pub const COMPACT2_MAX_DENSITY: f64 = 0.10;

impl DeltaOptions {
    /// A delta from `base_version` to `model_version`, TRL options at their default.
    pub fn new(encoding: Encoding, model_version: u64, base_version: u64) -> DeltaOptions {
        DeltaOptions {
            encoding,
            model_version,
            base_version,
            trl: TrlOptions::default(),
            compact2_max_density: COMPACT2_MAX_DENSITY,
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
    /// `compact2`: the tensor's context for the next delta, and its
    /// checksum.
    next: Option<(TensorContext, u64)>,
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
    // A dense `compact2` delta is written in `compact` (see
    // `DeltaOptions::compact2_max_density`).
    let gated;
    let opts = if opts.encoding == Encoding::Compact2
        && opts.compact2_max_density < 1.0
        && sampled_density(base, new) > opts.compact2_max_density
    {
        gated = DeltaOptions {
            encoding: Encoding::Compact,
            ..*opts
        };
        &gated
    } else {
        opts
    };
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
                Encoding::Compact => Ok(compact_out(
                    idx,
                    &t.name,
                    compact::encode_tensor(key_kind(t.dtype), wb, t.seed, old, nw),
                )),
                Encoding::Compact2 => {
                    let tctx = context.and_then(|c| c.tensors.get(&t.name));
                    let ctx_seed = compact::context::tensor_seed(&t.name);
                    let e = compact::v2::encode_tensor(
                        key_kind(t.dtype),
                        wb,
                        t.seed,
                        (old, nw),
                        (tctx, ctx_seed),
                    );
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
                        next: Some((e.next, e.checksum)),
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

    let (out, summary, next, digests) = assemble(base, outs, opts, context, new.metadata())?;
    for (idx, d) in digests.into_iter().enumerate() {
        new.set_digest(idx, d);
    }
    new.mark_digests_valid();
    Ok((out, summary, next))
}

/// Pages ([`SAMPLE_PAGE`] bytes) of each tensor [`sampled_density`] reads
/// one of.
const SAMPLE_EVERY: usize = 64;
/// Bytes of one sampled stretch: a page, whole words of every width.
const SAMPLE_PAGE: usize = 4096;

/// The share of `base`'s words that differ in `new` (the same structure),
/// estimated from one 4 KiB page in every 64 of each tensor (its first
/// page included): about 1.6% of the data compared, before a
/// `compact2` delta is encoded, to choose its encoding.
pub fn sampled_density(base: &TensorSet, new: &TensorSet) -> f64 {
    /// Words of `W` bytes that differ between `a` and `b` (equal lengths).
    fn differing<const W: usize>(a: &[u8], b: &[u8]) -> u64 {
        let (a, _) = a.as_chunks::<W>();
        let (b, _) = b.as_chunks::<W>();
        a.iter().zip(b).filter(|(x, y)| x != y).count() as u64
    }
    let (mut changed, mut words) = (0u64, 0u64);
    for (idx, t) in base.tensors().iter().enumerate() {
        let wb = word_bytes(t.dtype);
        let (a, b) = (base.data(idx), new.data(idx));
        for start in (0..a.len()).step_by(SAMPLE_PAGE * SAMPLE_EVERY) {
            let end = (start + SAMPLE_PAGE).min(a.len());
            let (x, y) = (&a[start..end], &b[start..end]);
            changed += match wb {
                1 => differing::<1>(x, y),
                2 => differing::<2>(x, y),
                4 => differing::<4>(x, y),
                8 => differing::<8>(x, y),
                w => x
                    .chunks_exact(w)
                    .zip(y.chunks_exact(w))
                    .filter(|(p, q)| p != q)
                    .count() as u64,
            };
            words += ((end - start) / wb) as u64;
        }
    }
    if words == 0 {
        0.0
    } else {
        changed as f64 / words as f64
    }
}

/// One tensor's changes for [`encode_delta_changes`]: its name, the changed
/// word indices (strictly ascending) and their new words, in order.
#[derive(Clone, Copy, Debug)]
pub struct TensorChanges<'a> {
    /// The tensor.
    pub name: &'a str,
    /// Changed word indices.
    pub positions: compact::PositionSlice<'a>,
    /// Their new words, `word_bytes(dtype)` bytes each.
    pub new: &'a [u8],
}

/// A `compact` delta from `base` made of changes the caller found (a trainer
/// that compared two versions on its GPU): no pass over the tensors, the old
/// words read from `base` at the changed positions only. Tensors `changes`
/// does not name are unchanged. Returns the object, its summary, and the new
/// state's tensor digests in `base`'s order (derived from `base`'s).
///
/// The delta carries `base`'s `__metadata__`. Fails with
/// [`Error::BaseMismatch`] when a listed word equals its old one (the changes
/// were found against another state), [`Error::Tensor`] for malformed
/// changes, [`Error::StructureChanged`] for a tensor `base` lacks.
pub fn encode_delta_changes(
    base: &TensorSet,
    changes: &[TensorChanges<'_>],
    opts: &DeltaOptions,
) -> Result<(Vec<u8>, DeltaSummary, Vec<Digest>)> {
    if !base.has_digests() {
        return Err(Error::metadata("base", "base tensor set has no digests"));
    }
    if opts.encoding != Encoding::Compact {
        return Err(Error::Unsupported {
            encoding: "compact",
            tensor: "(any)".into(),
            reason: format!(
                "changes found by the caller are encoded as `compact` only, not `{}`",
                opts.encoding
            ),
        });
    }
    let mut by_tensor: Vec<Option<&TensorChanges<'_>>> = vec![None; base.len()];
    for c in changes {
        let idx = base.position(c.name).ok_or_else(|| {
            Error::StructureChanged(format!("tensor `{}` is not in the base", c.name))
        })?;
        if by_tensor[idx].replace(c).is_some() {
            return Err(Error::Tensor {
                tensor: c.name.to_string(),
                reason: "its changes are given twice".into(),
            });
        }
    }
    let outs: Vec<TensorOut> = base
        .tensors()
        .par_iter()
        .enumerate()
        .map(|(idx, t)| -> Result<TensorOut> {
            let e = match by_tensor[idx] {
                Some(c) if !c.positions.is_empty() => compact::encode_tensor_changes(
                    key_kind(t.dtype),
                    word_bytes(t.dtype),
                    t.seed,
                    &t.name,
                    base.data(idx),
                    c.positions,
                    c.new,
                )?,
                _ => compact::EncodedTensor {
                    changed: 0,
                    digest_change: 0,
                    blocks: Vec::new(),
                    payload: Vec::new(),
                },
            };
            Ok(compact_out(idx, &t.name, e))
        })
        .collect::<Result<_>>()?;
    let (out, summary, _, digests) = assemble(base, outs, opts, None, base.metadata())?;
    Ok((out, summary, digests))
}

fn compact_out(idx: usize, name: &str, e: compact::EncodedTensor) -> TensorOut {
    TensorOut {
        idx,
        changed: e.changed,
        digest_change: e.digest_change,
        payload: vec![(
            format!("{name}{}", compact::SUFFIX),
            Dtype::U8,
            vec![e.payload.len()],
            e.payload,
        )],
        blocks: Some(e.blocks),
        next: None,
    }
}

/// The delta object from its tensors' parts: header, payload, summary, the
/// next `compact2` context, and every tensor's new digest (in `base`'s order).
#[allow(clippy::type_complexity)]
fn assemble(
    base: &TensorSet,
    outs: Vec<TensorOut>,
    opts: &DeltaOptions,
    context: Option<&Context>,
    metadata: &BTreeMap<String, String>,
) -> Result<(Vec<u8>, DeltaSummary, Option<Context>, Vec<Digest>)> {
    let mut digests: Vec<Digest> = base.tensors().iter().map(|t| t.digest).collect();
    let mut entries = BTreeMap::new();
    let mut payload = Vec::new();
    let mut next_tensors = BTreeMap::new();
    // The next context's checksum, as the encoders summed it.
    let mut checksum = 0u64;
    let (mut changed, mut total) = (0u64, 0u64);
    for mut o in outs {
        let t = &base.tensors()[o.idx];
        let words = t.words() as u64;
        total += words;
        let digest = t.digest.wrapping_add(Digest(o.digest_change));
        digests[o.idx] = digest;
        if o.changed == 0 {
            continue;
        }
        if let Some((next, sum)) = o.next.take() {
            next_tensors.insert(t.name.clone(), next);
            checksum = checksum.wrapping_add(sum);
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
    payload.sort_by(|a, b| a.0.cmp(&b.0));

    let mut hasher = blake3::Hasher::new();
    for p in &payload {
        crate::digest::blake3_update(&mut hasher, &p.3);
    }
    let header = Header {
        kind: Kind::Delta,
        encoding: opts.encoding,
        model_version: opts.model_version,
        base_version: Some(opts.base_version),
        base_digest: Some(base.digest()),
        digest: digests
            .iter()
            .fold(Digest::default(), |a, &d| a.wrapping_add(d)),
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
    meta.insert(keys::METADATA.into(), trainer_metadata_json(metadata));
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
        Context::with_checksum(
            opts.model_version,
            (base.digest(), header.digest),
            next_tensors,
            checksum,
        )
    });
    Ok((out, summary, next, digests))
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::apply_delta;
    use crate::codec::compact::{BLOCK_WORDS, PositionSlice};
    use crate::dtype::read_word;

    /// A base and a new state of three tensors: a bf16 one of more than one
    /// block with ±1-ulp steps, an f32 one whose changes are large jumps
    /// (raw values), and an unchanged u8 one; with each tensor's changed
    /// positions and new words.
    #[allow(clippy::type_complexity)]
    fn states() -> (TensorSet, TensorSet, Vec<(String, Vec<u64>, Vec<u8>)>) {
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let mut rnd = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let big = BLOCK_WORDS as usize + 4099;
        let shapes: [(&str, Dtype, usize); 3] = [
            ("a.bf16", Dtype::BF16, big),
            ("b.f32", Dtype::F32, 5000),
            ("c.u8", Dtype::U8, 300),
        ];
        let (mut base, mut new, mut changes) = (Vec::new(), Vec::new(), Vec::new());
        for (name, dtype, words) in shapes {
            let wb = word_bytes(dtype);
            let old: Vec<u8> = (0..words * wb).map(|_| rnd() as u8 & 0x3f).collect();
            let mut nw = old.clone();
            let (mut pos, mut vals) = (Vec::new(), Vec::new());
            if dtype != Dtype::U8 {
                for i in 0..words {
                    // dense at the start, sparse later, the last word too
                    if (i < 64 || rnd() % 61 == 0 || i == words - 1) && i != 70 {
                        let w = read_word(&old, wb, i);
                        let w2 = if dtype == Dtype::F32 {
                            w ^ 0x4000_0000
                        } else {
                            w + 1
                        };
                        nw[i * wb..(i + 1) * wb].copy_from_slice(&w2.to_le_bytes()[..wb]);
                        pos.push(i as u64);
                        vals.extend_from_slice(&w2.to_le_bytes()[..wb]);
                    }
                }
            }
            base.push((name.to_string(), dtype, vec![words], old));
            new.push((name.to_string(), dtype, vec![words], nw));
            changes.push((name.to_string(), pos, vals));
        }
        (
            TensorSet::from_tensors(base).unwrap(),
            TensorSet::from_tensors(new).unwrap(),
            changes,
        )
    }

    /// A bf16 tensor of `words` words and a copy with every `every`-th word
    /// moved by one.
    fn pair_every(words: usize, every: usize) -> (TensorSet, TensorSet) {
        let old: Vec<u8> = (0..words)
            .flat_map(|i| (0x3f00u16 + (i % 251) as u16).to_le_bytes())
            .collect();
        let mut nw = old.clone();
        for i in (0..words).step_by(every) {
            nw[2 * i] ^= 1;
        }
        let set = |b: Vec<u8>| {
            TensorSet::from_tensors([("w".to_string(), Dtype::BF16, vec![words], b)]).unwrap()
        };
        (set(old), set(nw))
    }

    /// `compact2` is written up to `compact2_max_density` and `compact`
    /// above it (no context left), from the sampled density; 1.0 keeps
    /// `compact2` at every density. A sparse delta is not affected.
    #[test]
    fn a_dense_compact2_delta_is_written_in_compact() {
        // 1 in 4 changed (25%), 1 in 50 (2%), over 3 MiB: many sampled pages.
        let (base, dense) = pair_every(3 << 20, 4);
        let (_, sparse) = pair_every(3 << 20, 50);
        let d = sampled_density(&base, &dense);
        assert!((d - 0.25).abs() < 1e-3, "{d}");
        let d = sampled_density(&base, &sparse);
        assert!((d - 0.02).abs() < 1e-3, "{d}");
        assert_eq!(sampled_density(&base, &base), 0.0);
        let run = |new: &TensorSet, max: f64| {
            let opts = DeltaOptions {
                compact2_max_density: max,
                ..DeltaOptions::new(Encoding::Compact2, 1, 0)
            };
            let (bytes, summary, next) =
                encode_delta_ctx(&base, &mut new.clone(), &opts, None).unwrap();
            let (_, header) = crate::codec::inspect(&bytes).unwrap();
            let header = header.expect("a delta has a header");
            assert_eq!(header.encoding, summary.encoding);
            let mut state = base.clone();
            crate::codec::apply_delta(&mut state, &bytes).unwrap();
            assert_eq!(state.digest(), new.digest());
            (summary.encoding, next.is_some())
        };
        assert_eq!(
            run(&dense, COMPACT2_MAX_DENSITY),
            (Encoding::Compact, false)
        );
        assert_eq!(run(&dense, 1.0), (Encoding::Compact2, true));
        assert_eq!(run(&dense, 0.3), (Encoding::Compact2, true));
        assert_eq!(
            run(&sparse, COMPACT2_MAX_DENSITY),
            (Encoding::Compact2, true)
        );
        assert_eq!(run(&sparse, 0.01), (Encoding::Compact, false));
    }

    #[test]
    fn changes_given_encode_the_delta_a_scan_finds() {
        let (base, new, changes) = states();
        let opts = DeltaOptions::new(Encoding::Compact, 1, 0);
        let mut scanned = new.clone();
        let (dense, dense_summary) = encode_delta(&base, &mut scanned, &opts).unwrap();
        let narrow: Vec<Vec<u32>> = changes
            .iter()
            .map(|c| c.1.iter().map(|&p| p as u32).collect())
            .collect();
        for wide in [true, false] {
            let given: Vec<TensorChanges<'_>> = changes
                .iter()
                .zip(&narrow)
                .map(|((n, p, v), p32)| TensorChanges {
                    name: n,
                    positions: if wide {
                        PositionSlice::U64(p)
                    } else {
                        PositionSlice::U32(p32)
                    },
                    new: v,
                })
                .collect();
            let (bytes, summary, digests) = encode_delta_changes(&base, &given, &opts).unwrap();
            assert_eq!(summary.changed, dense_summary.changed);
            assert_eq!(summary.digest, dense_summary.digest);
            let expect: Vec<Digest> = scanned.tensors().iter().map(|t| t.digest).collect();
            assert_eq!(digests, expect);
            // Staged exactly, never larger than the scanning encoder's.
            assert!(
                bytes.len() <= dense.len() + 64,
                "{} vs {}",
                bytes.len(),
                dense.len()
            );
            let mut state = base.clone();
            apply_delta(&mut state, &bytes).unwrap();
            for i in 0..new.len() {
                assert!(
                    state.data(i) == new.data(i),
                    "tensor {i} differs after applying"
                );
            }
        }
    }

    #[test]
    fn malformed_or_foreign_changes_are_refused_by_name() {
        let (base, _, changes) = states();
        let opts = DeltaOptions::new(Encoding::Compact, 1, 0);
        let (name, pos, vals) = &changes[0];
        let run = |pos: &[u64], vals: &[u8], n: &str| {
            let one = [TensorChanges {
                name: n,
                positions: PositionSlice::U64(pos),
                new: vals,
            }];
            encode_delta_changes(&base, &one, &opts).unwrap_err()
        };
        // out of order
        let mut swapped = pos.clone();
        swapped.swap(3, 4);
        let e = run(&swapped, vals, name);
        assert!(
            matches!(&e, Error::Tensor { tensor, reason } if tensor == name && reason.contains("ascending")),
            "{e}"
        );
        // repeated
        let mut twice = pos.clone();
        twice[4] = twice[3];
        assert!(matches!(run(&twice, vals, name), Error::Tensor { .. }));
        // outside the tensor
        let mut far = pos.clone();
        *far.last_mut().unwrap() = base.tensors()[0].words() as u64;
        let e = run(&far, vals, name);
        assert!(e.to_string().contains("outside the tensor"), "{e}");
        // wrong length of new words
        let e = run(pos, &vals[..vals.len() - 2], name);
        assert!(e.to_string().contains("bytes of new words"), "{e}");
        // a word the base already has: found against another state
        let mut same = vals.clone();
        same[10..12].copy_from_slice(&base.data(0)[2 * pos[5] as usize..2 * pos[5] as usize + 2]);
        let e = run(pos, &same, name);
        assert!(
            matches!(&e, Error::BaseMismatch(m) if m.contains(name.as_str())),
            "{e}"
        );
        // a tensor the base lacks
        assert!(matches!(run(pos, vals, "nope"), Error::StructureChanged(_)));
        // another encoding
        let one = [TensorChanges {
            name,
            positions: PositionSlice::U64(pos),
            new: vals,
        }];
        let opts2 = DeltaOptions::new(Encoding::Compact2, 1, 0);
        assert!(matches!(
            encode_delta_changes(&base, &one, &opts2),
            Err(Error::Unsupported { .. })
        ));
    }
}
