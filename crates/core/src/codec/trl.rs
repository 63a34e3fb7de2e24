//! The `trl` delta encoding: Hugging Face TRL's `sparse_weight_patch` layout,
//! in both of its generations (docs/format.md §6.2 and §11).
//!
//! - **v1** (TRL PR #5417): for each changed parameter `<name>.indices` (I32,
//!   strictly ascending flat element indices) and `<name>.values` (the
//!   parameter's dtype, the absolute new values); a `changed_params` JSON list
//!   in the header.
//! - **v3** (TRL PRs #5932/#5937): `<name>.idx` and `<name>.val`; the header's
//!   `encoding` says how `.idx` is coded: `raw` (I32 positions), `gap_delta`
//!   (U16 gaps, U32 for a parameter with a gap over 0xFFFF) or
//!   `nvcomp_cascaded` (a GPU codec weightcast cannot decode).
//!
//! Values are absolute, so applying is a pure scatter. This module also holds
//! TRL's header keys (written exactly as TRL's Python writer renders them),
//! the checks weightcast makes on TRL files that carry no digests, and TRL
//! anchors.

use std::collections::BTreeMap;
use std::io::Write;

use safetensors::SafeTensors;

use crate::digest::{ChangeBatch, LANES, TensorSeed};
use crate::dtype::{Dtype, is_packed, load, read_word, store, write_word};
use crate::error::{Error, Result};
use crate::format::{TrlGeneration, TrlIndexEncoding, TrlOptions};
use crate::tensors::TensorSet;

use super::header::{AnchorSummary, anchor_header};
use super::scan::for_each_change_piece;
use crate::platform::prefetch_l2;

/// Suffix of the index tensor (v1).
pub const INDICES: &str = ".indices";
/// Suffix of the value tensor (v1).
pub const VALUES: &str = ".values";
/// Suffix of the index tensor (v3).
pub const IDX: &str = ".idx";
/// Suffix of the value tensor (v3).
pub const VAL: &str = ".val";

/// TRL's header keys (its `PatchMetadata` fields; every value a Python `str()`).
pub mod keys {
    /// `"sparse_weight_patch"`.
    pub const FORMAT: &str = "format";
    /// `"1"` in every generation.
    pub const VERSION: &str = "version";
    /// `"True"` (delta) or `"False"` (anchor).
    pub const SPARSE: &str = "sparse";
    /// TRL's sync counter: the step in the object's key.
    pub const MODEL_VERSION: &str = "model_version";
    /// Parameters in the file.
    pub const NUM_CHANGED_PARAMS: &str = "num_changed_params";
    /// Σ of the parameters' changed elements (anchors: Σ numel).
    pub const TOTAL_CHANGED_ELEMENTS: &str = "total_changed_elements";
    /// Σ numel (see docs/format.md §6.2 for which parameters are counted).
    pub const TOTAL_ELEMENTS: &str = "total_elements";
    /// `1 - total_changed_elements / max(total_elements, 1)`, Python `str(float)`.
    pub const SPARSITY: &str = "sparsity";
    /// v1: JSON list of the parameters in the file.
    pub const CHANGED_PARAMS: &str = "changed_params";
    /// v3: the index encoding (`raw`, `gap_delta`, `nvcomp_cascaded`).
    pub const ENCODING: &str = "encoding";
}

/// Value of TRL's `format` key.
pub const FORMAT_NAME: &str = "sparse_weight_patch";
/// Value of TRL's `version` key (every generation writes `"1"`).
pub const FORMAT_VERSION: &str = "1";

/// TRL's step (sync counter, from 1) of weightcast version `version` (from 0):
/// `version + 1`. TRL's `model_version` header key and its object keys use it.
pub fn step_of_version(version: u64) -> u64 {
    version.saturating_add(1)
}

/// The weightcast version of TRL step `step` (`step - 1`; `None` for step 0,
/// which TRL never writes).
pub fn version_of_step(step: u64) -> Option<u64> {
    step.checked_sub(1)
}

/// A TRL-encoded tensor.
pub struct EncodedTensor {
    /// Changed elements.
    pub changed: u64,
    /// Wrapping digest change.
    pub digest_change: u64,
    /// Little-endian I32 indices.
    pub indices: Vec<u8>,
    /// Little-endian new values.
    pub values: Vec<u8>,
}

/// Checks that TRL can represent a tensor of this dtype and size.
pub fn check_representable(name: &str, dtype: Dtype, words: usize) -> Result<()> {
    if is_packed(dtype) {
        return Err(Error::Unsupported {
            encoding: "trl",
            tensor: name.to_string(),
            reason: format!("{dtype} packs several elements per byte"),
        });
    }
    if words > i32::MAX as usize + 1 {
        return Err(Error::Unsupported {
            encoding: "trl",
            tensor: name.to_string(),
            reason: format!("{words} elements exceed I32 indices"),
        });
    }
    Ok(())
}

/// Diffs and encodes one tensor.
pub fn encode_tensor(wb: usize, seed: TensorSeed, base: &[u8], new: &[u8]) -> EncodedTensor {
    crate::with_word_width!(wb, W => encode_tensor_w::<W>(seed, base, new))
}

#[inline(always)]
fn encode_tensor_w<const W: usize>(seed: TensorSeed, base: &[u8], new: &[u8]) -> EncodedTensor {
    let mut out = EncodedTensor {
        changed: 0,
        digest_change: 0,
        indices: Vec::new(),
        values: Vec::new(),
    };
    for_each_change_piece(W, base, new, |first, changed, pa, pb| {
        out.changed += changed.len() as u64;
        let (at_i, at_v) = (out.indices.len(), out.values.len());
        out.indices.resize(at_i + changed.len() * 4, 0);
        out.values.resize(at_v + changed.len() * W, 0);
        let indices = out.indices[at_i..].chunks_mut(4 * LANES);
        let values = out.values[at_v..].chunks_mut(W * LANES);
        // The digest change sixteen changes at a time (AVX-512 where present).
        for (chunk, (ix, vs)) in changed.chunks(LANES).zip(indices.zip(values)) {
            let mut batch = ChangeBatch::default();
            for (j, &c) in chunk.iter().enumerate() {
                let (c, i) = (c as usize, first + c as usize);
                ix[j * 4..j * 4 + 4].copy_from_slice(&(i as i32).to_le_bytes());
                vs[j * W..j * W + W].copy_from_slice(&pb[c * W..c * W + W]);
                (batch.index[j], batch.old[j], batch.new[j]) =
                    (i as u64, load::<W>(pa, c), load::<W>(pb, c));
            }
            out.digest_change = out.digest_change.wrapping_add(seed.change_sum(&batch));
        }
    });
    out
}

/// Recodes ascending I32 positions (little-endian) as TRL's `gap_delta`:
/// `gap[k] = idx[k] - idx[k-1] - 1` with `idx[-1] = -1`, as U16 when every gap
/// fits, else U32 (TRL's per-parameter width rule; an empty list is U16).
pub fn gap_encode(indices: &[u8]) -> (Dtype, Vec<u8>) {
    let positions = || {
        indices
            .chunks_exact(4)
            .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as i64)
    };
    let mut prev = -1i64;
    let mut widest = 0i64;
    for i in positions() {
        widest = widest.max(i - prev - 1);
        prev = i;
    }
    let wide = widest > 0xFFFF;
    let mut out = Vec::with_capacity(indices.len() / if wide { 1 } else { 2 });
    prev = -1;
    for i in positions() {
        let gap = i - prev - 1;
        prev = i;
        if wide {
            out.extend_from_slice(&(gap as u32).to_le_bytes());
        } else {
            out.extend_from_slice(&(gap as u16).to_le_bytes());
        }
    }
    (if wide { Dtype::U32 } else { Dtype::U16 }, out)
}

/// One payload tensor: name, dtype, shape, bytes.
pub type PayloadTensor = (String, Dtype, Vec<usize>, Vec<u8>);

/// The payload tensors of one changed parameter in the layout `opts` names.
pub fn payload_tensors(
    name: &str,
    dtype: Dtype,
    e: EncodedTensor,
    opts: &TrlOptions,
) -> Result<Vec<PayloadTensor>> {
    let n = e.changed as usize;
    let values = |suffix: &str| (format!("{name}{suffix}"), dtype, vec![n], e.values);
    Ok(match (opts.generation, opts.index) {
        (TrlGeneration::V1, _) => vec![
            (format!("{name}{INDICES}"), Dtype::I32, vec![n], e.indices),
            values(VALUES),
        ],
        (TrlGeneration::V3, TrlIndexEncoding::Raw) => vec![
            (format!("{name}{IDX}"), Dtype::I32, vec![n], e.indices),
            values(VAL),
        ],
        (TrlGeneration::V3, TrlIndexEncoding::GapDelta) => {
            let (d, gaps) = gap_encode(&e.indices);
            vec![(format!("{name}{IDX}"), d, vec![n], gaps), values(VAL)]
        }
        (TrlGeneration::V3, TrlIndexEncoding::NvcompCascaded) => {
            return Err(nvcomp_unsupported(name));
        }
    })
}

fn nvcomp_unsupported(name: &str) -> Error {
    Error::Unsupported {
        encoding: "nvcomp_cascaded",
        tensor: name.to_string(),
        reason: "TRL's nvcomp_cascaded index encoding is nvCOMP's GPU codec: it needs nvCOMP \
                 on a GPU, which weightcast does not use. weightcast reads and writes TRL's \
                 raw and gap_delta index encodings (set TRL's weight_sync_encoding to one of \
                 them)"
            .into(),
    }
}

// ---------------------------------------------------------------------------
// Header keys, rendered as TRL's Python writer renders them.

/// Python's `str(float)` (the shortest repr that round-trips): `0.0`,
/// `0.9876`, `1e-05`, `1e+16`.
pub fn py_float(x: f64) -> String {
    if x.is_nan() {
        return "nan".into();
    }
    if x.is_infinite() {
        return if x > 0.0 { "inf" } else { "-inf" }.into();
    }
    if x == 0.0 {
        return if x.is_sign_negative() { "-0.0" } else { "0.0" }.into();
    }
    // Rust's `{:e}` prints the shortest round-tripping digits, as Python's repr.
    let e = format!("{x:e}");
    let (mant, exp) = e.split_once('e').expect("`{:e}` has an exponent");
    let exp: i32 = exp.parse().expect("decimal exponent");
    let (sign, mant) = mant.strip_prefix('-').map_or(("", mant), |m| ("-", m));
    let digits: String = mant.chars().filter(|c| *c != '.').collect();
    let decpt = exp + 1; // digits d1 d2 ... with the point after `decpt` of them
    let n = digits.len() as i32;
    let body = if -4 < decpt && decpt <= 16 {
        if decpt <= 0 {
            format!("0.{}{digits}", "0".repeat((-decpt) as usize))
        } else if decpt >= n {
            format!("{digits}{}.0", "0".repeat((decpt - n) as usize))
        } else {
            format!(
                "{}.{}",
                &digits[..decpt as usize],
                &digits[decpt as usize..]
            )
        }
    } else {
        let rest = if n > 1 {
            format!(".{}", &digits[1..])
        } else {
            String::new()
        };
        let es = if exp < 0 { '-' } else { '+' };
        format!("{}{rest}e{es}{:02}", &digits[..1], exp.unsigned_abs())
    };
    format!("{sign}{body}")
}

/// Python's `json.dumps(list_of_str)`: `", "` between items and every
/// non-ASCII character escaped (`ensure_ascii`).
pub fn py_json_list<S: AsRef<str>>(items: &[S]) -> String {
    let mut out = String::from("[");
    for (k, s) in items.iter().enumerate() {
        if k > 0 {
            out.push_str(", ");
        }
        out.push('"');
        for c in s.as_ref().chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\t' => out.push_str("\\t"),
                '\u{8}' => out.push_str("\\b"),
                '\u{c}' => out.push_str("\\f"),
                c if (c as u32) < 0x20 || (c as u32) > 0x7e => {
                    let mut units = [0u16; 2];
                    for u in c.encode_utf16(&mut units) {
                        out.push_str(&format!("\\u{u:04x}"));
                    }
                }
                c => out.push(c),
            }
        }
        out.push('"');
    }
    out.push(']');
    out
}

/// TRL's `sparsity`, computed as TRL computes it.
fn sparsity(changed: u64, total: u64) -> f64 {
    1.0 - changed as f64 / total.max(1) as f64
}

/// The keys every TRL object carries.
fn common_keys(
    meta: &mut BTreeMap<String, String>,
    sparse: bool,
    model_version: u64,
    params: &[&str],
    changed: u64,
    total: u64,
    opts: &TrlOptions,
) {
    let mut put = |k: &str, v: String| {
        meta.insert(k.to_string(), v);
    };
    put(keys::FORMAT, FORMAT_NAME.into());
    put(keys::VERSION, FORMAT_VERSION.into());
    put(keys::SPARSE, if sparse { "True" } else { "False" }.into());
    put(
        keys::MODEL_VERSION,
        step_of_version(model_version).to_string(),
    );
    put(keys::NUM_CHANGED_PARAMS, params.len().to_string());
    put(keys::TOTAL_CHANGED_ELEMENTS, changed.to_string());
    put(keys::TOTAL_ELEMENTS, total.to_string());
    put(keys::SPARSITY, py_float(sparsity(changed, total)));
    match opts.generation {
        TrlGeneration::V1 => put(keys::CHANGED_PARAMS, py_json_list(params)),
        TrlGeneration::V3 => put(keys::ENCODING, opts.index.as_str().into()),
    }
}

/// Adds TRL's delta keys to a weightcast delta's metadata. `model_version` is
/// weightcast's (TRL's `model_version` is its step, one more); `params` are the
/// parameters with payload tensors; `total` is the file state's element count
/// (TRL v1 counts only the parameters in the file: docs/format.md §6.2).
pub fn delta_keys(
    meta: &mut BTreeMap<String, String>,
    model_version: u64,
    params: &[&str],
    changed: u64,
    total: u64,
    opts: &TrlOptions,
) {
    common_keys(meta, true, model_version, params, changed, total, opts);
}

/// Adds TRL's anchor keys (`sparse="False"`, every tensor counted as changed)
/// to an anchor's metadata; `format` becomes `sparse_weight_patch`, as TRL's
/// anchors have it, instead of weightcast's `pt`.
pub fn anchor_keys(
    meta: &mut BTreeMap<String, String>,
    set: &TensorSet,
    model_version: u64,
    opts: &TrlOptions,
) {
    let names: Vec<&str> = set.tensors().iter().map(|t| t.name.as_str()).collect();
    let total = set.total_elements();
    common_keys(meta, false, model_version, &names, total, total, opts);
}

/// Streams `set` as a TRL anchor: every tensor under its own name, weightcast's
/// anchor keys (digests: a weightcast reader verifies it) and TRL's anchor keys.
/// Kept apart from [`super::write_anchor`]: a TRL receiver reads plain
/// safetensors, so a TRL anchor is never compressed.
pub fn write_anchor(
    set: &TensorSet,
    model_version: u64,
    opts: &TrlOptions,
    w: &mut impl Write,
) -> Result<AnchorSummary> {
    if !set.has_digests() {
        return Err(Error::metadata("anchor", "tensor set has no digests"));
    }
    let header = anchor_header(set, model_version);
    let mut meta = header.to_metadata();
    anchor_keys(&mut meta, set, model_version, opts);
    let mut counted = Counted { inner: w, bytes: 0 };
    set.write_to(&meta, &mut counted)?;
    Ok(AnchorSummary {
        model_version,
        tensors: set.len(),
        total: set.total_elements(),
        bytes: counted.bytes,
        digest: header.digest.to_string(),
    })
}

/// The bytes [`write_anchor`] writes before the tensor data (length and
/// header); the data follows contiguously in the order of
/// [`TensorSet::tensors`], as with [`super::anchor_prefix`].
pub fn anchor_prefix(set: &TensorSet, model_version: u64, opts: &TrlOptions) -> Result<Vec<u8>> {
    if !set.has_digests() {
        return Err(Error::metadata("anchor", "tensor set has no digests"));
    }
    let mut meta = anchor_header(set, model_version).to_metadata();
    anchor_keys(&mut meta, set, model_version, opts);
    let views: Vec<(&str, crate::dtype::Dtype, &[usize], &[u8])> = set
        .tensors()
        .iter()
        .enumerate()
        .map(|(i, t)| (t.name.as_str(), t.dtype, t.shape.as_slice(), set.data(i)))
        .collect();
    let head = crate::tensors::safetensors_header(&views, &meta)?;
    let mut out = Vec::with_capacity(8 + head.len());
    out.extend_from_slice(&(head.len() as u64).to_le_bytes());
    out.extend_from_slice(&head);
    Ok(out)
}

/// [`write_anchor`] into a new vector.
pub fn encode_anchor(
    set: &TensorSet,
    model_version: u64,
    opts: &TrlOptions,
) -> Result<(Vec<u8>, AnchorSummary)> {
    let mut out = Vec::with_capacity(set.total_bytes() as usize + 4096);
    let s = write_anchor(set, model_version, opts, &mut out)?;
    Ok((out, s))
}

struct Counted<'a, W: Write> {
    inner: &'a mut W,
    bytes: u64,
}

impl<W: Write> Write for Counted<'_, W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.bytes += n as u64;
        Ok(n)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

// ---------------------------------------------------------------------------
// Reading.

/// How an index tensor codes positions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Coding {
    /// Absolute positions, I32.
    I32,
    /// Absolute positions, I64 (accepted from other writers).
    I64,
    /// `gap_delta`, U16 gaps.
    Gap16,
    /// `gap_delta`, U32 gaps.
    Gap32,
}

impl Coding {
    fn width(self) -> usize {
        match self {
            Coding::I32 | Coding::Gap32 => 4,
            Coding::I64 => 8,
            Coding::Gap16 => 2,
        }
    }
}

/// The index tensor of one parameter: absolute positions (I32 or I64) or
/// TRL v3 `gap_delta` gaps (U16 or U32), read in order.
#[derive(Clone, Copy, Debug)]
pub struct Indices<'a> {
    bytes: &'a [u8],
    coding: Coding,
}

impl<'a> Indices<'a> {
    /// Absolute positions: `dtype` must be I32 (what TRL writes) or I64.
    pub fn new(tensor: &str, dtype: Dtype, bytes: &'a [u8]) -> Result<Self> {
        let coding = match dtype {
            Dtype::I32 => Coding::I32,
            Dtype::I64 => Coding::I64,
            other => {
                return Err(Error::tensor(
                    tensor,
                    format!("indices must be I32 or I64, found {other}"),
                ));
            }
        };
        Ok(Indices { bytes, coding })
    }

    /// TRL v3 `gap_delta` gaps: `dtype` must be U16 or U32.
    pub fn gaps(tensor: &str, dtype: Dtype, bytes: &'a [u8]) -> Result<Self> {
        let coding = match dtype {
            Dtype::U16 => Coding::Gap16,
            Dtype::U32 => Coding::Gap32,
            other => {
                return Err(Error::tensor(
                    tensor,
                    format!("gap_delta indices must be U16 or U32, found {other}"),
                ));
            }
        };
        Ok(Indices { bytes, coding })
    }

    /// Number of indices.
    pub fn len(&self) -> usize {
        self.bytes.len() / self.coding.width()
    }

    /// Whether there is no index.
    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }
}

/// Reads positions in order, decoding gaps. Positions are `i64`; gap sums wrap
/// rather than overflow (a wrapped value is refused as out of range or not
/// ascending where it is used).
trait Source: Copy {
    fn next(&mut self) -> i64;
}

macro_rules! source {
    ($name:ident, $n:literal, $t:ty, $gap:literal) => {
        #[derive(Clone, Copy)]
        struct $name<'a> {
            bytes: &'a [u8],
            at: usize,
            prev: i64,
        }
        impl Source for $name<'_> {
            #[inline(always)]
            fn next(&mut self) -> i64 {
                let mut b = [0u8; $n];
                b.copy_from_slice(&self.bytes[self.at..self.at + $n]);
                self.at += $n;
                let v = <$t>::from_le_bytes(b) as i64;
                if $gap {
                    self.prev = self.prev.wrapping_add(v).wrapping_add(1);
                    self.prev
                } else {
                    v
                }
            }
        }
    };
}
source!(Abs32, 4, i32, false);
source!(Abs64, 8, i64, false);
source!(Gap16, 2, u16, true);
source!(Gap32, 4, u32, true);

/// Runs `$body` with `$s` bound to a [`Source`] over `$ix`, monomorphic in
/// the coding.
macro_rules! with_source {
    ($ix:expr, $s:ident => $body:expr) => {{
        let ix: Indices<'_> = $ix;
        match ix.coding {
            Coding::I32 => {
                let $s = Abs32 {
                    bytes: ix.bytes,
                    at: 0,
                    prev: -1,
                };
                $body
            }
            Coding::I64 => {
                let $s = Abs64 {
                    bytes: ix.bytes,
                    at: 0,
                    prev: -1,
                };
                $body
            }
            Coding::Gap16 => {
                let $s = Gap16 {
                    bytes: ix.bytes,
                    at: 0,
                    prev: -1,
                };
                $body
            }
            Coding::Gap32 => {
                let $s = Gap32 {
                    bytes: ix.bytes,
                    at: 0,
                    prev: -1,
                };
                $body
            }
        }
    }};
}

impl Indices<'_> {
    /// Calls `f` with each position, in order (gaps decoded), until it
    /// returns `false` (the codec's apply loops read positions through this).
    #[inline]
    pub fn visit(&self, mut f: impl FnMut(i64) -> bool) {
        let n = self.len();
        with_source!(*self, s => {
            let mut s = s;
            for _ in 0..n {
                if !f(s.next()) {
                    break;
                }
            }
        })
    }
}

/// Finds and validates the payload pair of parameter `name` (of `dtype`) in a
/// TRL file: `.indices`/`.values` (v1) or `.idx`/`.val` (v3). `index` is the
/// file's v3 index encoding when the caller read it from the header; without
/// it (weightcast's own files) a v3 index tensor's dtype says: I32/I64 raw,
/// U16/U32 gaps. Checks: both present, 1-D, values of the parameter's dtype, a
/// representable dtype, an index dtype the coding allows. Counts, order and
/// bounds are checked by [`apply`].
pub fn payload<'a>(
    name: &str,
    dtype: Dtype,
    st: &SafeTensors<'a>,
    index: Option<TrlIndexEncoding>,
) -> Result<(Indices<'a>, &'a [u8])> {
    let has = |suffix: &str| st.tensor(&format!("{name}{suffix}")).is_ok();
    let v3 = !has(INDICES) && !has(VALUES) && (has(IDX) || has(VAL));
    let (ik, vk) = if v3 { (IDX, VAL) } else { (INDICES, VALUES) };
    let (ik, vk) = (format!("{name}{ik}"), format!("{name}{vk}"));
    let iv = st
        .tensor(&ik)
        .map_err(|_| Error::tensor(name, format!("`{ik}` missing")))?;
    let vv = st
        .tensor(&vk)
        .map_err(|_| Error::tensor(name, format!("`{vk}` missing")))?;
    if iv.shape().len() != 1 || vv.shape().len() != 1 {
        return Err(Error::tensor(name, "indices and values must be 1-D"));
    }
    if vv.dtype() != dtype {
        return Err(Error::tensor(
            name,
            format!("values are {}, the parameter is {dtype}", vv.dtype()),
        ));
    }
    check_representable(name, dtype, 0)?;
    let indices = if !v3 {
        Indices::new(name, iv.dtype(), iv.data())?
    } else {
        match (index, iv.dtype()) {
            (Some(TrlIndexEncoding::NvcompCascaded), _) | (None, Dtype::U8) => {
                return Err(nvcomp_unsupported(name));
            }
            (Some(TrlIndexEncoding::GapDelta), d) => Indices::gaps(name, d, iv.data())?,
            (None, d @ (Dtype::U16 | Dtype::U32)) => Indices::gaps(name, d, iv.data())?,
            (Some(TrlIndexEncoding::Raw) | None, d) => {
                Indices::new(name, d, iv.data()).map_err(|_| {
                    Error::tensor(name, format!("raw indices must be I32 (or I64), found {d}"))
                })?
            }
        }
    };
    Ok((indices, vv.data()))
}

/// Applies a TRL tensor in place: validates indices (strictly ascending, in
/// range) and value count, writes the new values, appends overwritten old words
/// to `undo`, and returns (changed, digest change). On error, what was written
/// is recorded in `undo` (see [`undo`]).
pub fn apply(
    tensor: &str,
    indices: Indices<'_>,
    values: &[u8],
    wb: usize,
    seed: TensorSeed,
    base: &mut [u8],
    undo: &mut Vec<u8>,
) -> Result<(u64, u64)> {
    let n = indices.len();
    if values.len() != n * wb {
        return Err(Error::tensor(
            tensor,
            format!(
                "{n} indices but {} value bytes ({wb} per value)",
                values.len()
            ),
        ));
    }
    undo.reserve(n.min(base.len() / wb) * wb);
    crate::with_word_width!(wb, W => with_source!(indices, s =>
        apply_w::<W, _>(tensor, s, n, values, seed, base, undo)))
}

/// How many indices ahead [`apply_w`] prefetches each target's line into L2:
/// the writes land at scattered positions of a model-sized buffer, so each
/// would otherwise wait for memory (the same distance as the compact apply's
/// pipeline, `codec::compact`).
const PREFETCH_AHEAD: usize = 256;

fn apply_w<const W: usize, S: Source>(
    tensor: &str,
    mut cur: S,
    n: usize,
    values: &[u8],
    seed: TensorSeed,
    base: &mut [u8],
    undo: &mut Vec<u8>,
) -> Result<(u64, u64)> {
    let words = (base.len() / W) as i64;
    // A second reader PREFETCH_AHEAD positions ahead (gaps are decoded twice:
    // cheaper than a buffer of positions).
    let mut ahead = cur;
    for _ in 0..PREFETCH_AHEAD.min(n) {
        ahead.next();
    }
    let mut prev = -1i64;
    let mut dig = 0u64;
    for lo in (0..n).step_by(LANES) {
        let mut batch = ChangeBatch::default();
        for j in lo..(lo + LANES).min(n) {
            if j + PREFETCH_AHEAD < n {
                // A hint only: an index out of range is ignored here and
                // refused when its turn comes.
                prefetch_l2(base, (ahead.next() as usize).wrapping_mul(W));
            }
            let i = cur.next();
            if i <= prev {
                return Err(Error::tensor(
                    tensor,
                    format!("index {j} ({i}) is not strictly ascending"),
                ));
            }
            if i >= words {
                return Err(Error::tensor(
                    tensor,
                    format!("index {i} is beyond {words} elements"),
                ));
            }
            prev = i;
            let old = load::<W>(base, i as usize);
            let new = load::<W>(values, j);
            undo.extend_from_slice(&base[i as usize * W..i as usize * W + W]);
            store::<W>(base, i as usize, new);
            (batch.index[j - lo], batch.old[j - lo], batch.new[j - lo]) = (i as u64, old, new);
        }
        dig = dig.wrapping_add(seed.change_sum(&batch));
    }
    Ok((n as u64, dig))
}

/// Restores the old words recorded by [`apply`].
pub fn undo(indices: Indices<'_>, wb: usize, base: &mut [u8], undo: &[u8]) {
    with_source!(indices, s => {
        let mut s = s;
        for j in 0..undo.len() / wb {
            write_word(base, wb, s.next() as usize, read_word(undo, wb, j));
        }
    })
}

// ---------------------------------------------------------------------------
// Foreign TRL files: which parameters, and what the header claims.

/// The parameters of a TRL delta without weightcast keys, its generation and
/// (v3) index encoding, found from its tensor names and header.
#[derive(Clone, Debug)]
pub struct ForeignDelta {
    /// Generation, from the tensor names (the header when there is no tensor).
    pub generation: TrlGeneration,
    /// v3's index encoding (`encoding` key; TRL's default `gap_delta` when absent).
    pub index: Option<TrlIndexEncoding>,
    /// The parameters with a payload pair, as listed (v1 `changed_params`) or
    /// found (`.values` / `.val` tensors, sorted).
    pub params: Vec<String>,
}

/// Reads which parameters a foreign TRL delta holds. Refuses a file that mixes
/// v1 and v3 tensor names, an unknown or GPU-only (`nvcomp_cascaded`) index
/// encoding, a `changed_params` that is not a JSON list of distinct names.
pub fn foreign_delta(map: &BTreeMap<String, String>, st: &SafeTensors<'_>) -> Result<ForeignDelta> {
    let names = st.names();
    let ends = |a: &str, b: &str| names.iter().any(|k| k.ends_with(a) || k.ends_with(b));
    let generation = match (ends(INDICES, VALUES), ends(IDX, VAL)) {
        (true, true) => {
            return Err(Error::Container(
                "the file mixes TRL v1 (`.indices`/`.values`) and v3 (`.idx`/`.val`) tensors"
                    .into(),
            ));
        }
        (true, false) => TrlGeneration::V1,
        (false, true) => TrlGeneration::V3,
        (false, false)
            if map.contains_key(keys::ENCODING) && !map.contains_key(keys::CHANGED_PARAMS) =>
        {
            TrlGeneration::V3
        }
        (false, false) => TrlGeneration::V1,
    };
    if let Some(v) = map.get(keys::VERSION)
        && v != FORMAT_VERSION
    {
        return Err(Error::metadata(
            keys::VERSION,
            format!("TRL format version `{v}` is not supported (weightcast reads \"1\")"),
        ));
    }
    model_version_key(map)?;
    let index = match generation {
        TrlGeneration::V1 => None,
        TrlGeneration::V3 => Some(
            map.get(keys::ENCODING)
                .map_or(Ok(TrlIndexEncoding::GapDelta), |s| s.parse())?,
        ),
    };
    let suffix = if generation == TrlGeneration::V1 {
        VALUES
    } else {
        VAL
    };
    let mut found: Vec<String> = names
        .iter()
        .filter_map(|k| k.strip_suffix(suffix).map(str::to_string))
        .collect();
    found.sort();
    let params: Vec<String> = match (generation, map.get(keys::CHANGED_PARAMS)) {
        (TrlGeneration::V1, Some(s)) => serde_json::from_str(s).map_err(|e| {
            Error::metadata(
                keys::CHANGED_PARAMS,
                format!("not a JSON list of names: {e}"),
            )
        })?,
        _ => found,
    };
    let mut seen = std::collections::HashSet::new();
    for p in &params {
        if !seen.insert(p.as_str()) {
            return Err(Error::metadata(
                keys::CHANGED_PARAMS,
                format!("`{p}` listed twice"),
            ));
        }
    }
    if index == Some(TrlIndexEncoding::NvcompCascaded) {
        return Err(nvcomp_unsupported(
            params.first().map_or("(every parameter)", String::as_str),
        ));
    }
    Ok(ForeignDelta {
        generation,
        index,
        params,
    })
}

fn parse_u64(map: &BTreeMap<String, String>, k: &str) -> Result<Option<u64>> {
    map.get(k)
        .map(|v| {
            v.parse::<u64>()
                .map_err(|e| Error::metadata(k, format!("`{v}` is not a count: {e}")))
        })
        .transpose()
}

/// TRL's `model_version` key, when present (a decimal count).
pub fn model_version_key(map: &BTreeMap<String, String>) -> Result<Option<u64>> {
    parse_u64(map, keys::MODEL_VERSION)
}

/// Checks the counts a TRL header claims against what the file holds, where
/// they can be compared: `num_changed_params` (the parameters with a pair,
/// empty pairs included), `total_changed_elements` (Σ pair lengths),
/// `total_elements` (Σ numel of the parameters in the file, TRL's rule, or of
/// the whole file state, weightcast's: `total_state`), `sparsity` (a number in
/// [0, 1] agreeing with the two totals). Absent keys are not required.
pub fn check_counts(
    map: &BTreeMap<String, String>,
    params: usize,
    changed: u64,
    total_in_file: u64,
    total_state: u64,
) -> Result<()> {
    if let Some(n) = parse_u64(map, keys::NUM_CHANGED_PARAMS)?
        && n != params as u64
    {
        return Err(Error::metadata(
            keys::NUM_CHANGED_PARAMS,
            format!("says {n}, the file holds {params} parameters"),
        ));
    }
    if let Some(n) = parse_u64(map, keys::TOTAL_CHANGED_ELEMENTS)?
        && n != changed
    {
        return Err(Error::metadata(
            keys::TOTAL_CHANGED_ELEMENTS,
            format!("says {n}, the file holds {changed}"),
        ));
    }
    let total = parse_u64(map, keys::TOTAL_ELEMENTS)?;
    if let Some(n) = total
        && n != total_in_file
        && n != total_state
    {
        return Err(Error::metadata(
            keys::TOTAL_ELEMENTS,
            format!(
                "says {n}; the parameters in the file have {total_in_file} elements, the \
                 whole state {total_state}"
            ),
        ));
    }
    if let Some(s) = map.get(keys::SPARSITY) {
        let v: f64 = s
            .parse()
            .map_err(|e| Error::metadata(keys::SPARSITY, format!("`{s}` is not a number: {e}")))?;
        if !(0.0..=1.0).contains(&v) {
            return Err(Error::metadata(
                keys::SPARSITY,
                format!("{s} is not within [0, 1]"),
            ));
        }
        if let (Some(c), Some(t)) = (parse_u64(map, keys::TOTAL_CHANGED_ELEMENTS)?, total)
            && (v - sparsity(c, t)).abs() > 1e-9
        {
            return Err(Error::metadata(
                keys::SPARSITY,
                format!("{s} disagrees with total_changed_elements / total_elements ({c} / {t})"),
            ));
        }
    }
    Ok(())
}

/// Checks a TRL anchor's header against its tensors: `format` and
/// `sparse="False"` present, `version` 1, `num_changed_params` the tensor
/// count, both element totals the tensors' Σ numel, `sparsity` consistent, v1
/// `changed_params` exactly the tensor names, v3 `encoding` a known value.
/// Returns TRL's `model_version` (the step) when the header has one.
pub fn check_anchor(map: &BTreeMap<String, String>, set: &TensorSet) -> Result<Option<u64>> {
    if map.get(keys::FORMAT).map(String::as_str) != Some(FORMAT_NAME) {
        return Err(Error::metadata(
            keys::FORMAT,
            format!("a TRL anchor has format=\"{FORMAT_NAME}\""),
        ));
    }
    if map.get(keys::SPARSE).map(String::as_str) != Some("False") {
        return Err(Error::metadata(
            keys::SPARSE,
            "a TRL anchor has sparse=\"False\" (is this a delta under anchors/?)",
        ));
    }
    if let Some(v) = map.get(keys::VERSION)
        && v != FORMAT_VERSION
    {
        return Err(Error::metadata(
            keys::VERSION,
            format!("TRL format version `{v}` is not supported (weightcast reads \"1\")"),
        ));
    }
    if let Some(e) = map.get(keys::ENCODING) {
        e.parse::<TrlIndexEncoding>()?;
    }
    let total = set.total_elements();
    check_counts(map, set.len(), total, total, total)?;
    if let Some(s) = map.get(keys::CHANGED_PARAMS) {
        let listed: Vec<String> = serde_json::from_str(s).map_err(|e| {
            Error::metadata(
                keys::CHANGED_PARAMS,
                format!("not a JSON list of names: {e}"),
            )
        })?;
        let mut listed_sorted = listed.clone();
        listed_sorted.sort();
        let names: Vec<&str> = set.tensors().iter().map(|t| t.name.as_str()).collect();
        if listed_sorted != names {
            return Err(Error::metadata(
                keys::CHANGED_PARAMS,
                format!(
                    "lists {} names that are not the anchor's {} tensors",
                    listed.len(),
                    names.len()
                ),
            ));
        }
    }
    model_version_key(map)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_anchor_prefix_is_what_write_anchor_writes_first() {
        let mut g = crate::generator::Generator::new(crate::generator::GeneratorConfig::tiny(3));
        let set = g.snapshot();
        g.step();
        for opts in [TrlOptions::V1, TrlOptions::V3] {
            let (bytes, _) = encode_anchor(&set, 4, &opts).unwrap();
            let prefix = anchor_prefix(&set, 4, &opts).unwrap();
            assert_eq!(&bytes[..prefix.len()], &prefix[..]);
            assert_eq!(bytes.len() as u64, prefix.len() as u64 + set.total_bytes());
        }
    }

    #[test]
    fn floats_render_as_python_str() {
        // Expected strings are Python 3's `str(x)` for the same doubles.
        let cases: &[(f64, &str)] = &[
            (0.0, "0.0"),
            (1.0, "1.0"),
            (0.5, "0.5"),
            (0.1, "0.1"),
            (1.0 - 12345.0 / 1843200.0, "0.9933024088541667"),
            (1.0 - 2254257.0 / 613432259.0, "0.9963251736977856"),
            (1.0 - 1058756.0 / 274937043.0, "0.9961490965769935"),
            (1.0 - 7541208.0 / 514610672.0, "0.9853457994357334"),
            (1.0 - 3522457.0 / 104303420.0, "0.9662287487792826"),
            (1.0 - 3.0 / 7e12, "0.9999999999995715"),
            (3.0 / 7e12, "4.2857142857142856e-13"),
            (1.0 - 1.0 / 3.0, "0.6666666666666667"),
            (1e-4, "0.0001"),
            (1e-5, "1e-05"),
            (1.5e-7, "1.5e-07"),
            (123456.0, "123456.0"),
            (1e15, "1000000000000000.0"),
            (1e16, "1e+16"),
            (2.5e20, "2.5e+20"),
            (-0.25, "-0.25"),
        ];
        for &(x, want) in cases {
            assert_eq!(py_float(x), want, "{x:e}");
        }
    }

    #[test]
    fn lists_render_as_python_json_dumps() {
        assert_eq!(py_json_list::<&str>(&[]), "[]");
        assert_eq!(py_json_list(&["a.b", "c"]), r#"["a.b", "c"]"#);
        assert_eq!(
            py_json_list(&["q\"\\\n\u{1}", "é😀"]),
            r#"["q\"\\\n\u0001", "\u00e9\ud83d\ude00"]"#
        );
    }

    fn i32s(v: &[i32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    fn decode(ix: Indices<'_>) -> Vec<i64> {
        let n = ix.len();
        with_source!(ix, s => {
            let mut s = s;
            (0..n).map(|_| s.next()).collect()
        })
    }

    #[test]
    fn gaps_round_trip_and_pick_their_width() {
        for (pos, width) in [
            (vec![], Dtype::U16),
            (vec![0], Dtype::U16),
            (vec![3, 4, 60_000], Dtype::U16),
            (vec![3, 4, 70_003], Dtype::U32),
            (vec![0, 65_536], Dtype::U16), // gap 65 536 - 0 - 1 = 0xFFFF fits
            (vec![0, 65_537], Dtype::U32), // gap 0x10000
            (vec![70_000, 70_001, 2_000_000_000], Dtype::U32),
        ] {
            let (d, gaps) = gap_encode(&i32s(&pos));
            assert_eq!(d, width, "{pos:?}");
            let ix = Indices::gaps("t", d, &gaps).unwrap();
            assert_eq!(ix.len(), pos.len());
            let back = decode(ix);
            assert_eq!(back, pos.iter().map(|&p| p as i64).collect::<Vec<_>>());
        }
        // gap[k] = idx[k] - idx[k-1] - 1 with idx[-1] = -1.
        let (_, g) = gap_encode(&i32s(&[0, 2, 3]));
        assert_eq!(g, [0, 0, 1, 0, 0, 0]);
        assert!(Indices::gaps("t", Dtype::I32, &[]).is_err());
    }

    #[test]
    fn v3_gap_apply_undo_restores() {
        let seed = TensorSeed::new("w", Dtype::BF16, &[8]);
        let mut base: Vec<u8> = (0..16).collect();
        let orig = base.clone();
        let (_, gaps) = gap_encode(&i32s(&[1, 5]));
        let ix = Indices::gaps("w", Dtype::U16, &gaps).unwrap();
        let mut u = Vec::new();
        let (n, _) = apply("w", ix, &[9, 9, 8, 8], 2, seed, &mut base, &mut u).unwrap();
        assert_eq!(n, 2);
        assert_eq!(&base[2..4], &[9, 9]);
        assert_eq!(&base[10..12], &[8, 8]);
        undo(ix, 2, &mut base, &u);
        assert_eq!(base, orig);
        // A gap past the end is refused by the bounds check.
        let (_, gaps) = gap_encode(&i32s(&[1, 8]));
        let ix = Indices::gaps("w", Dtype::U16, &gaps).unwrap();
        let e = apply("w", ix, &[0; 4], 2, seed, &mut base, &mut Vec::new()).unwrap_err();
        assert!(
            e.to_string().contains("index 8 is beyond 8 elements"),
            "{e}"
        );
    }

    #[test]
    fn versions_and_steps() {
        assert_eq!(step_of_version(0), 1);
        assert_eq!(version_of_step(1), Some(0));
        assert_eq!(version_of_step(0), None);
    }
}
