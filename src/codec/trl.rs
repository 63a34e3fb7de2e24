//! The `trl` delta encoding: the Hugging Face TRL `sparse_weight_patch` layout.
//! For each changed parameter, `<name>.indices` (I32, strictly ascending flat
//! element indices) and `<name>.values` (the parameter's dtype, the absolute new
//! values). Values are absolute, so applying is a pure scatter.

use crate::digest::{ChangeBatch, LANES, TensorSeed};
use crate::dtype::{Dtype, is_packed, load, read_word, store, write_word};
use crate::error::{Error, Result};

use super::cpu::prefetch_l2;
use super::scan::for_each_change_piece;

/// Suffix of the index tensor.
pub const INDICES: &str = ".indices";
/// Suffix of the value tensor.
pub const VALUES: &str = ".values";

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

/// Index tensor of a TRL file: I32 (what TRL writes) or I64 (accepted from other writers).
#[derive(Clone, Copy)]
pub struct Indices<'a> {
    bytes: &'a [u8],
    width: usize,
}

impl<'a> Indices<'a> {
    /// Wraps index bytes of `dtype`.
    pub fn new(tensor: &str, dtype: Dtype, bytes: &'a [u8]) -> Result<Self> {
        let width = match dtype {
            Dtype::I32 => 4,
            Dtype::I64 => 8,
            other => {
                return Err(Error::tensor(
                    tensor,
                    format!("indices must be I32 or I64, found {other}"),
                ));
            }
        };
        Ok(Indices { bytes, width })
    }

    /// Number of indices.
    pub fn len(&self) -> usize {
        self.bytes.len() / self.width
    }

    /// Whether there is no index.
    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    /// Calls `f` with each position, in order, until it returns `false`
    /// (the codec's apply loops read positions through this).
    #[inline]
    pub fn visit(&self, mut f: impl FnMut(i64) -> bool) {
        for j in 0..self.len() {
            if !f(self.get(j)) {
                break;
            }
        }
    }

    #[inline]
    fn get(&self, j: usize) -> i64 {
        let w = read_word(self.bytes, self.width, j);
        if self.width == 4 {
            w as u32 as i32 as i64
        } else {
            w as i64
        }
    }
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
    crate::with_word_width!(wb, W => apply_w::<W>(tensor, indices, values, seed, base, undo))
}

/// How many indices ahead [`apply_w`] prefetches each target's line into L2:
/// the writes land at scattered positions of a model-sized buffer, so each
/// would otherwise wait for memory (the same distance as the compact apply's
/// pipeline, `codec::compact`).
const PREFETCH_AHEAD: usize = 256;

fn apply_w<const W: usize>(
    tensor: &str,
    indices: Indices<'_>,
    values: &[u8],
    seed: TensorSeed,
    base: &mut [u8],
    undo: &mut Vec<u8>,
) -> Result<(u64, u64)> {
    let n = indices.len();
    let words = (base.len() / W) as i64;
    let mut prev = -1i64;
    let mut dig = 0u64;
    for lo in (0..n).step_by(LANES) {
        let mut batch = ChangeBatch::default();
        for j in lo..(lo + LANES).min(n) {
            if let Some(ahead) = j.checked_add(PREFETCH_AHEAD).filter(|&a| a < n) {
                // A hint only: an index out of range is ignored here and
                // refused when its turn comes.
                prefetch_l2(base, (indices.get(ahead) as usize).wrapping_mul(W));
            }
            let i = indices.get(j);
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
    for j in 0..undo.len() / wb {
        write_word(base, wb, indices.get(j) as usize, read_word(undo, wb, j));
    }
}
