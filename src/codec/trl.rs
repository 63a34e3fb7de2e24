//! The `trl` delta encoding: the Hugging Face TRL `sparse_weight_patch` layout.
//! For each changed parameter, `<name>.indices` (I32, strictly ascending flat
//! element indices) and `<name>.values` (the parameter's dtype, the absolute new
//! values). Values are absolute, so applying is a pure scatter.

use crate::digest::TensorSeed;
use crate::dtype::{Dtype, is_packed, read_word, write_word};
use crate::error::{Error, Result};

use super::scan::for_each_change;

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
    let wb = W;
    let mut out = EncodedTensor {
        changed: 0,
        digest_change: 0,
        indices: Vec::new(),
        values: Vec::new(),
    };
    for_each_change(wb, base, new, |i, old, nw| {
        out.changed += 1;
        out.indices.extend_from_slice(&(i as i32).to_le_bytes());
        out.values.extend_from_slice(&nw.to_le_bytes()[..W]);
        out.digest_change = out
            .digest_change
            .wrapping_add(seed.change(i as u64, old, nw));
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
    let words = (base.len() / wb) as i64;
    let mut prev = -1i64;
    let mut dig = 0u64;
    undo.reserve(n.min(words as usize) * wb);
    for j in 0..n {
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
        let old = read_word(base, wb, i as usize);
        let new = read_word(values, wb, j);
        undo.extend_from_slice(&old.to_le_bytes()[..wb]);
        write_word(base, wb, i as usize, new);
        dig = dig.wrapping_add(seed.change(i as u64, old, new));
    }
    Ok((n as u64, dig))
}

/// Restores the old words recorded by [`apply`].
pub fn undo(indices: Indices<'_>, wb: usize, base: &mut [u8], undo: &[u8]) {
    for j in 0..undo.len() / wb {
        write_word(base, wb, indices.get(j) as usize, read_word(undo, wb, j));
    }
}
