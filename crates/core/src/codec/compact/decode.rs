//! Decoding `compact` streams: the block directory, and the one definition of
//! how an entry is decoded.
//!
//! [`entry_slow`] is that definition, read bit by bit from
//! `docs/format.md` §6.1 with a checked [`BitReader`]. [`step_entry`] and
//! [`raw_entry`] are its fast paths: the usual entry is decoded from one
//! unaligned 8-byte load and two trailing-zero counts, with no refill state
//! (the apply pipeline keeps the bit position in a register); anything else
//! (a long gap or step, the stream's last bytes, a malformed code) goes to
//! `entry_slow`. [`decode_block`], the apply pipeline (`apply::decode_group`)
//! and the undo all decode through these, and `fast_paths_agree_with_the_reference`
//! checks the fast paths against `entry_slow` on arbitrary streams.

use super::{Block, MAX_POS_K, MAX_VAL_K, Value};
use crate::codec::bits::{BitReader, window};
use crate::dtype::word_mask;
use crate::error::{Error, Result};
use crate::format::{BlockEntry, ValueCoding};

/// Splits a payload into per-block streams, checking the directory against the
/// tensor (`words` words) and the payload's real length.
pub fn split_blocks<'a>(
    tensor: &str,
    words: u64,
    block_words: u64,
    blocks: &[BlockEntry],
    payload: &'a [u8],
) -> Result<Vec<&'a [u8]>> {
    if block_words == 0 {
        return Err(Error::metadata(
            format!("tensors.{tensor}.block_words"),
            "must be at least 1",
        ));
    }
    if words.div_ceil(block_words) != blocks.len() as u64 {
        return Err(Error::metadata(
            format!("tensors.{tensor}.blocks"),
            format!(
                "{} blocks listed, {words} words in blocks of {block_words} need {}",
                blocks.len(),
                words.div_ceil(block_words)
            ),
        ));
    }
    let mut out = Vec::with_capacity(blocks.len());
    let mut at = 0usize;
    for (b, e) in blocks.iter().enumerate() {
        let end = usize::try_from(e.bytes)
            .ok()
            .and_then(|n| at.checked_add(n))
            .filter(|&end| end <= payload.len())
            .ok_or_else(|| {
                Error::tensor(
                    tensor,
                    format!("block {b} claims more bytes than the payload holds"),
                )
            })?;
        out.push(&payload[at..end]);
        at = end;
    }
    if at != payload.len() {
        return Err(Error::tensor(
            tensor,
            format!("payload has {} bytes, blocks describe {at}", payload.len()),
        ));
    }
    Ok(out)
}

/// A block's coding parameters, checked against its directory entry and
/// stream, with the bounds its entries must keep.
#[derive(Clone, Copy, Debug)]
pub(super) struct Coding {
    /// Rice parameter of the gaps.
    k: u32,
    /// Exp-Golomb order of the step magnitudes.
    vk: u32,
    /// The largest unary quotient of a gap that can stay inside the block.
    q_limit: u64,
    /// The largest quotient the one-load fast paths take: `q_limit`, and at
    /// most `53 − k` so that a gap's code fits in 54 bits.
    fast_q: u32,
}

impl Coding {
    /// Checks `b`'s parameters (in range), its change count (at most one per
    /// word) and its stream (long enough for that many entries of at least
    /// `pos_k + 2` bits each: a lying count is refused up front).
    pub(super) fn check(b: &Block<'_>) -> Result<Coding> {
        let e = b.entry;
        if e.pos_k > MAX_POS_K || e.val_k > MAX_VAL_K {
            return Err(b.error("coding parameter out of range"));
        }
        if e.changes > b.words {
            return Err(b.error("more changes than words"));
        }
        let min_bits = e.changes.saturating_mul(e.pos_k as u64 + 2);
        if min_bits > b.stream.len() as u64 * 8 {
            return Err(b.error("stream too short for the claimed number of changes"));
        }
        let k = e.pos_k as u32;
        let q_limit = b.words >> k;
        Ok(Coding {
            k,
            vk: e.val_k as u32,
            q_limit,
            fast_q: q_limit.min(53 - k as u64) as u32,
        })
    }
}

/// The gap a window starts with and the length of its code, when the fast
/// paths take it (a quotient of at most `c.fast_q`).
#[inline(always)]
fn fast_gap(word: u64, c: &Coding) -> Option<(u64, u32)> {
    let tz = word.trailing_zeros();
    if tz > c.fast_q {
        return None;
    }
    let gap = ((tz as u64) << c.k) | ((word >> (tz + 1)) & ((1u64 << c.k) - 1));
    Some((gap, tz + 1 + c.k))
}

/// One entry of a step-coded block at bit `at` of `stream`: the gap, the
/// masked step and the bits it took; or what is wrong with it.
///
/// The fast path reads the 8 bytes holding bit `at` as one little-endian word
/// (at least 57 valid bits) and decodes an entry of up to 56 bits from it:
/// no refill state, no branch on the data except the length checks, which a
/// well-formed stream passes. Everything else goes to [`entry_slow`].
#[inline(always)]
pub(super) fn step_entry<const W: usize>(
    stream: &[u8],
    at: u64,
    c: &Coding,
) -> std::result::Result<(u64, u64, u32), &'static str> {
    if let Some(word) = window(stream, at)
        && let Some((gap, glen)) = fast_gap(word, c)
    {
        let vw = word >> glen;
        let z = vw.trailing_zeros();
        let width = z + c.vk;
        let used = glen + z + 1 + width + 1;
        if used <= 56 {
            let rest = (vw >> (z + 1)) & ((1u64 << width) - 1);
            let neg = (vw >> (z + 1 + width)) & 1;
            let m = ((1u64 << width) | rest) - (1u64 << c.vk) + 1;
            if m <= 1u64 << (W * 8 - 1) {
                // Branch-free negate: the sign is a coin flip.
                let s = ((m ^ neg.wrapping_neg()).wrapping_add(neg)) & word_mask(W);
                return Ok((gap, s, used));
            }
            return Err("step larger than the word");
        }
    }
    entry_slow::<W>(stream, at, c, false)
}

/// One entry of a raw-coded block at bit `at`: the gap, the new word and the
/// bits it took. Fast path as [`step_entry`]'s (for words that fit beside the
/// gap in 56 bits), else [`entry_slow`].
#[inline(always)]
pub(super) fn raw_entry<const W: usize>(
    stream: &[u8],
    at: u64,
    c: &Coding,
) -> std::result::Result<(u64, u64, u32), &'static str> {
    if W < 8
        && let Some(word) = window(stream, at)
        && let Some((gap, glen)) = fast_gap(word, c)
        && glen + 8 * W as u32 <= 56
    {
        return Ok((gap, (word >> glen) & word_mask(W), glen + 8 * W as u32));
    }
    entry_slow::<W>(stream, at, c, true)
}

/// The definition of an entry (docs/format.md §6.1), read with a checked bit
/// reader: the gap, the value (`raw`: the new word; otherwise the masked step)
/// and the bits it took. Every malformed case has its message here.
#[cold]
#[inline(never)]
pub(super) fn entry_slow<const W: usize>(
    stream: &[u8],
    at: u64,
    c: &Coding,
    raw: bool,
) -> std::result::Result<(u64, u64, u32), &'static str> {
    let mut r = BitReader::new(stream.get((at >> 3) as usize..).unwrap_or(&[]));
    let start = r.remaining_bits();
    r.get((at & 7) as u32)
        .ok_or("truncated or invalid position")?;
    let q = r.unary(c.q_limit).ok_or("truncated or invalid position")?;
    let gap = (q << c.k) | r.get(c.k).ok_or("truncated position")?;
    let value = if raw {
        r.get(8 * W as u32).ok_or("truncated value")?
    } else {
        let z = r.unary(64).ok_or("truncated or invalid step")?;
        let width = z + c.vk as u64;
        if width > 63 {
            return Err("step too large");
        }
        let rest = r.get(width as u32).ok_or("truncated step")?;
        let neg = r.get(1).ok_or("truncated sign")?;
        let m = ((1u64 << width) | rest) - (1u64 << c.vk) + 1;
        if m > 1u64 << (W * 8 - 1) {
            return Err("step larger than the word");
        }
        ((m ^ neg.wrapping_neg()).wrapping_add(neg)) & word_mask(W)
    };
    let used = start - r.remaining_bits() - (at & 7);
    Ok((gap, value, used as u32))
}

/// Whether a stream whose entries end at bit `at` ends cleanly: fewer than 8
/// bits left, all zero padding.
#[inline]
pub(super) fn clean_end(stream: &[u8], at: u64) -> bool {
    let total = stream.len() as u64 * 8;
    at <= total && total - at < 8 && (at == total || stream[stream.len() - 1] >> (at & 7) == 0)
}

/// Decodes one block, calling `f(index_in_block, value)` for each entry in
/// order, and checks that the stream holds exactly what the entry claims.
/// With `limit`, stops after that many entries and does not check the end
/// (the undo of a partial apply decodes the entries it wrote again).
pub fn decode_block(
    block: &Block<'_>,
    limit: Option<u64>,
    mut f: impl FnMut(u64, Value) -> Result<()>,
) -> Result<()> {
    if let Some(members) = block.context {
        // A `compact2` block: decoded whole, then handed over in order.
        return super::v2::with_scratch(|scratch, dec| {
            super::v2::decode(block, members, scratch, dec)?;
            let raw = block.entry.values == ValueCoding::Raw;
            let count = limit.map_or(dec.index.len(), |l| l.min(dec.index.len() as u64) as usize);
            for j in 0..count {
                let (i, v) = (dec.index[j] as u64, dec.value[j]);
                f(i, if raw { Value::Raw(v) } else { Value::Step(v) })?;
            }
            Ok(())
        });
    }
    let c = Coding::check(block)?;
    crate::with_word_width!(block.wb, W => decode_entries::<W>(block, &c, limit, f))
}

fn decode_entries<const W: usize>(
    block: &Block<'_>,
    c: &Coding,
    limit: Option<u64>,
    mut f: impl FnMut(u64, Value) -> Result<()>,
) -> Result<()> {
    let raw = block.entry.values == ValueCoding::Raw;
    let count = limit.map_or(block.entry.changes, |l| l.min(block.entry.changes));
    let (mut at, mut next) = (0u64, 0u64);
    for _ in 0..count {
        let entry = if raw {
            raw_entry::<W>(block.stream, at, c).map(|(g, v, u)| (g, Value::Raw(v), u))
        } else {
            step_entry::<W>(block.stream, at, c).map(|(g, s, u)| (g, Value::Step(s), u))
        };
        let (gap, v, used) = entry.map_err(|what| block.error(what))?;
        at += used as u64;
        let idx = next + gap;
        if idx >= block.words {
            return Err(block.error("position beyond the block"));
        }
        next = idx + 1;
        f(idx, v)?;
    }
    if limit.is_none() && !clean_end(block.stream, at) {
        return Err(block.error("trailing bytes after the last change"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn coding(pos_k: u8, val_k: u8, words: u64) -> Coding {
        let e = BlockEntry {
            changes: 0,
            pos_k,
            values: ValueCoding::Step,
            val_k,
            bytes: 0,
        };
        let b = Block {
            tensor: "t",
            index: 0,
            entry: &e,
            stream: &[],
            wb: 2,
            words,
            context: None,
        };
        Coding::check(&b).expect("valid parameters")
    }

    fn check_width<const W: usize>(stream: &[u8], c: &Coding) {
        for at in 0..stream.len() as u64 * 8 + 9 {
            assert_eq!(
                step_entry::<W>(stream, at, c),
                entry_slow::<W>(stream, at, c, false),
                "step entry at bit {at}, {c:?}"
            );
            assert_eq!(
                raw_entry::<W>(stream, at, c),
                entry_slow::<W>(stream, at, c, true),
                "raw entry at bit {at}, {c:?}"
            );
        }
    }

    proptest! {
        /// The fast paths decode exactly what the reference decodes (or fail
        /// with its message), at every bit offset of arbitrary streams, for
        /// every word width and a spread of parameters and block lengths.
        #[test]
        fn fast_paths_agree_with_the_reference(
            stream in proptest::collection::vec(
                prop_oneof![any::<u8>(), Just(0u8), Just(0xffu8), Just(0x80u8), Just(1u8)],
                0..40,
            ),
            pos_k in 0u8..=MAX_POS_K,
            val_k in prop_oneof![0u8..4, 0u8..=MAX_VAL_K],
            words in prop_oneof![1u64..100, 1u64..(1 << 24), Just(u64::MAX)],
        ) {
            let c = coding(pos_k, val_k, words);
            check_width::<1>(&stream, &c);
            check_width::<2>(&stream, &c);
            check_width::<4>(&stream, &c);
            check_width::<8>(&stream, &c);
        }
    }

    #[test]
    fn clean_ends() {
        assert!(clean_end(&[], 0));
        assert!(clean_end(&[0x01], 1));
        assert!(!clean_end(&[0x81], 1));
        assert!(!clean_end(&[0x01, 0], 1));
        assert!(clean_end(&[0xff], 8));
        assert!(!clean_end(&[0xff], 9));
    }
}
