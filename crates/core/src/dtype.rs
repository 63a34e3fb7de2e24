//! What the codec needs to know about a safetensors dtype: how wide one diff
//! *word* is and how to map a word to an integer whose differences are "ulp
//! steps".
//!
//! The diff never interprets values as numbers: two words are equal exactly
//! when their bytes are equal, so NaN payloads, `-0.0`, infinities and
//! subnormals round-trip untouched. The ordered-key mapping below is a
//! bijection on `w`-bit patterns; it only makes small value changes produce
//! small integer steps so they code in few bits.

pub use safetensors::Dtype;

use crate::error::{Error, Result};

/// How a dtype's words map to ordered integer keys.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeyKind {
    /// Sign-magnitude floats (F64, F32, F16, BF16, FP8 variants): the total-order
    /// key `x ^ sign` for positive patterns and `!x` for negative ones, so that
    /// adjacent representable values differ by one.
    SignMagnitude,
    /// Integers, packed sub-byte floats, bool, complex and exponent-only types:
    /// the word itself (two's-complement differences are already ulp steps).
    Identity,
}

/// Width in bytes of one diff word for `dtype`.
///
/// Byte-multiple dtypes diff element by element. Sub-byte dtypes (F4, F6_*),
/// whose elements are packed across bytes, diff byte by byte.
pub fn word_bytes(dtype: Dtype) -> usize {
    let bits = dtype.bitsize();
    if bits.is_multiple_of(8) { bits / 8 } else { 1 }
}

/// Whether a dtype is packed below one byte per element.
pub fn is_packed(dtype: Dtype) -> bool {
    !dtype.bitsize().is_multiple_of(8)
}

/// The key mapping used for `dtype`.
pub fn key_kind(dtype: Dtype) -> KeyKind {
    match dtype {
        Dtype::F64
        | Dtype::F32
        | Dtype::F16
        | Dtype::BF16
        | Dtype::F8_E4M3
        | Dtype::F8_E5M2
        | Dtype::F8_E4M3FNUZ
        | Dtype::F8_E5M2FNUZ => KeyKind::SignMagnitude,
        _ => KeyKind::Identity,
    }
}

/// Parses a dtype name as written in safetensors headers (`"BF16"`, `"F8_E4M3"`, ...).
pub fn parse_dtype(name: &str) -> Result<Dtype> {
    serde_json::from_value(serde_json::Value::String(name.to_string()))
        .map_err(|_| Error::metadata("dtype", format!("unknown dtype `{name}`")))
}

/// Number of bytes a tensor of `dtype` and `shape` occupies, checked for overflow
/// and for packed dtypes ending on a byte boundary.
pub fn byte_len(dtype: Dtype, shape: &[usize]) -> Option<usize> {
    let elements = shape
        .iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))?;
    let bits = elements.checked_mul(dtype.bitsize())?;
    (bits % 8 == 0).then_some(bits / 8)
}

/// Number of elements of `shape` (1 for a 0-d tensor), checked.
pub fn element_count(shape: &[usize]) -> Option<u64> {
    shape
        .iter()
        .try_fold(1u64, |acc, &d| acc.checked_mul(d as u64))
}

/// Mask of the low `bytes * 8` bits.
#[inline]
pub fn word_mask(bytes: usize) -> u64 {
    if bytes >= 8 {
        u64::MAX
    } else {
        (1u64 << (bytes * 8)) - 1
    }
}

/// Maps a word to its ordered key (see [`KeyKind`]): `!w` for negative
/// patterns, `w | sign` for positive ones. Branch-free: weight signs are random,
/// so a branch here would mispredict half the time.
#[inline]
pub fn to_key(kind: KeyKind, bytes: usize, word: u64) -> u64 {
    match kind {
        KeyKind::Identity => word,
        KeyKind::SignMagnitude => {
            let top = bytes as u32 * 8 - 1;
            let sign = 1u64 << top;
            let flip = ((word >> top) & 1).wrapping_neg() & word_mask(bytes);
            (word ^ flip) | (sign & !flip)
        }
    }
}

/// Inverse of [`to_key`] (branch-free as well).
#[inline]
pub fn from_key(kind: KeyKind, bytes: usize, key: u64) -> u64 {
    match kind {
        KeyKind::Identity => key,
        KeyKind::SignMagnitude => {
            let top = bytes as u32 * 8 - 1;
            let sign = 1u64 << top;
            let flip = (((key >> top) & 1) ^ 1).wrapping_neg() & word_mask(bytes);
            (key ^ flip) & !(sign & !flip)
        }
    }
}

/// Magnitude of a `bytes`-wide two's-complement step (branch-free).
#[inline]
pub fn step_magnitude(bytes: usize, step: u64) -> u64 {
    let top = bytes as u32 * 8 - 1;
    let neg = (step >> top) & 1;
    let flip = neg.wrapping_neg() & word_mask(bytes);
    ((step ^ flip).wrapping_add(neg)) & word_mask(bytes)
}

/// Reads the little-endian `W`-byte word `i` of `data`.
#[inline(always)]
pub fn load<const W: usize>(data: &[u8], i: usize) -> u64 {
    let mut b = [0u8; 8];
    b[..W].copy_from_slice(&data[i * W..i * W + W]);
    u64::from_le_bytes(b)
}

/// Writes the little-endian `W`-byte word `i` of `data`.
#[inline(always)]
pub fn store<const W: usize>(data: &mut [u8], i: usize, word: u64) {
    data[i * W..i * W + W].copy_from_slice(&word.to_le_bytes()[..W]);
}

/// Evaluates `$body` with `const $w: usize` set to the word width `$wb` (1, 2, 4
/// or 8), so hot loops are compiled once per width with fixed-size word access.
#[macro_export]
macro_rules! with_word_width {
    ($wb:expr, $w:ident => $body:expr) => {
        match $wb {
            1 => {
                const $w: usize = 1;
                $body
            }
            2 => {
                const $w: usize = 2;
                $body
            }
            4 => {
                const $w: usize = 4;
                $body
            }
            8 => {
                const $w: usize = 8;
                $body
            }
            other => unreachable!("word width {other}"),
        }
    };
}

/// Reads the little-endian word `i` of `data` (`bytes` wide).
#[inline]
pub fn read_word(data: &[u8], bytes: usize, i: usize) -> u64 {
    with_word_width!(bytes, W => load::<W>(data, i))
}

/// Writes the little-endian word `i` of `data` (`bytes` wide).
#[inline]
pub fn write_word(data: &mut [u8], bytes: usize, i: usize, word: u64) {
    with_word_width!(bytes, W => store::<W>(data, i, word))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_bijective_and_ordered_for_bf16() {
        let kind = KeyKind::SignMagnitude;
        let mut seen = vec![false; 1 << 16];
        for w in 0u64..(1 << 16) {
            let k = to_key(kind, 2, w);
            assert!(k < (1 << 16));
            assert!(!seen[k as usize], "key collision at {w:#x}");
            seen[k as usize] = true;
            assert_eq!(from_key(kind, 2, k), w);
        }
        // Ordering follows the float value for finite numbers.
        let vals = [-3.0f32, -1.0, -1e-30, -0.0, 0.0, 1e-30, 1.0, 2.5];
        let keys: Vec<u64> = vals
            .iter()
            .map(|v| to_key(kind, 2, half::bf16::from_f32(*v).to_bits() as u64))
            .collect();
        assert!(keys.windows(2).all(|p| p[0] < p[1]), "{keys:?}");
        // Adjacent representable values differ by one key.
        let one = half::bf16::from_f32(1.0).to_bits() as u64;
        assert_eq!(to_key(kind, 2, one + 1) - to_key(kind, 2, one), 1);
    }

    #[test]
    fn keys_round_trip_wide_words() {
        for bytes in [1usize, 2, 4, 8] {
            for w in [0u64, 1, 0x7f, 0x80, 0xff, u64::MAX, 0x8000_0000_0000_0000] {
                let w = w & word_mask(bytes);
                let k = to_key(KeyKind::SignMagnitude, bytes, w);
                assert_eq!(from_key(KeyKind::SignMagnitude, bytes, k), w);
            }
        }
    }

    #[test]
    fn step_magnitudes() {
        assert_eq!(step_magnitude(2, 1), 1);
        assert_eq!(step_magnitude(2, 0xffff), 1);
        assert_eq!(step_magnitude(2, 0x8000), 0x8000);
        assert_eq!(step_magnitude(8, u64::MAX), 1);
        assert_eq!(step_magnitude(8, 1 << 63), 1 << 63);
        assert_eq!(step_magnitude(1, 0x81), 0x7f);
    }

    #[test]
    fn word_widths() {
        assert_eq!(word_bytes(Dtype::BF16), 2);
        assert_eq!(word_bytes(Dtype::F64), 8);
        assert_eq!(word_bytes(Dtype::F4), 1);
        assert_eq!(word_bytes(Dtype::BOOL), 1);
        assert_eq!(byte_len(Dtype::F4, &[3]), None);
        assert_eq!(byte_len(Dtype::F4, &[4]), Some(2));
        assert_eq!(byte_len(Dtype::F32, &[]), Some(4));
        assert_eq!(parse_dtype("F8_E4M3").unwrap(), Dtype::F8_E4M3);
        assert!(parse_dtype("Q4").is_err());
    }
}
