//! The bit-level block decoder `compact::decode_block` on untrusted streams.
//!
//! Input layout (`examples/fuzz_seeds.rs` writes seeds in it):
//!
//! | bytes | meaning |
//! |-------|---------|
//! | 0     | flags: bit 0 = raw values (else step), bits 1–2 = word width 1/2/4/8, bit 3 = "huge" `changes` (high 48 bits set) |
//! | 1–2   | `changes`, u16 LE |
//! | 3–5   | block length in words, u24 LE, taken modulo 2^16 + 1 |
//! | 6     | `pos_k`, modulo 48 (41..47 must be rejected) |
//! | 7     | `val_k`, modulo 40 (33..39 must be rejected) |
//! | 8..   | the block's bit stream |
//!
//! Checks:
//! - the callback runs at most `changes` times (exactly that many on `Ok`), with
//!   strictly ascending indices below the block length, raw values within the
//!   word and steps non-zero and within the word;
//! - the result and the entries equal those of a slow bit-by-bit reference
//!   decoder written from `docs/format.md` (differential check of the fast paths);
//! - decoding again with `limit` = the entries delivered the first time succeeds
//!   and yields the same entries (what `undo_block` relies on);
//! - an error returned by the callback stops decoding and is returned.

#![no_main]

use libfuzzer_sys::fuzz_target;
use weightcast::codec::compact::{Block, MAX_POS_K, MAX_VAL_K, Value, decode_block};
use weightcast::dtype::word_mask;
use weightcast::format::{BlockEntry, ValueCoding};

const HEAD: usize = 8;
const MAX_BLOCK_LEN: u64 = 1 << 16;

/// An entry as comparable data: (index, is_raw, value).
type Entry = (u64, bool, u64);

fn entry(i: u64, v: Value) -> Entry {
    match v {
        Value::Raw(x) => (i, true, x),
        Value::Step(s) => (i, false, s),
    }
}

fuzz_target!(|data: &[u8]| {
    if data.len() < HEAD {
        return;
    }
    let flags = data[0];
    let raw = flags & 1 == 1;
    let wb = [1usize, 2, 4, 8][((flags >> 1) & 3) as usize];
    let mut changes = u16::from_le_bytes([data[1], data[2]]) as u64;
    if flags & 8 != 0 {
        changes |= u64::MAX << 16;
    }
    let block_len = u32::from_le_bytes([data[3], data[4], data[5], 0]) as u64 % (MAX_BLOCK_LEN + 1);
    let stream = &data[HEAD..];
    let e = BlockEntry {
        changes,
        pos_k: data[6] % 48,
        values: if raw {
            ValueCoding::Raw
        } else {
            ValueCoding::Step
        },
        val_k: data[7] % 40,
        bytes: stream.len() as u64,
    };
    let mask = word_mask(wb);
    let half = 1u64 << (wb * 8 - 1);
    let block = Block {
        tensor: "t",
        index: 0,
        entry: &e,
        stream,
        wb,
        words: block_len,
        context: None,
    };

    // 1. Full decode, checking every entry as it comes.
    let mut got: Vec<Entry> = Vec::new();
    let r = decode_block(&block, None, |i, v| {
        assert!(
            (got.len() as u64) < changes,
            "callback called more than changes={changes} times"
        );
        assert!(i < block_len, "index {i} beyond block length {block_len}");
        if let Some(&(prev, _, _)) = got.last() {
            assert!(i > prev, "index {i} after {prev}: not ascending");
        }
        match v {
            Value::Raw(x) => {
                assert!(raw, "raw value in a step block");
                assert!(x <= mask, "raw value {x:#x} wider than {wb} bytes");
            }
            Value::Step(s) => {
                assert!(!raw, "step value in a raw block");
                assert!(s != 0, "zero step: a change that changes nothing");
                assert!(s <= mask, "step {s:#x} wider than {wb} bytes");
                let m = if s & half != 0 {
                    s.wrapping_neg() & mask
                } else {
                    s
                };
                assert!(m <= half, "step magnitude {m} larger than the word");
            }
        }
        got.push(entry(i, v));
        Ok(())
    });
    if r.is_ok() {
        assert_eq!(
            got.len() as u64,
            changes,
            "Ok after fewer than changes entries"
        );
    }

    // 2. Differential check against the reference decoder.
    let (want, ok) = reference(&e, stream, wb, block_len);
    assert_eq!(got, want, "entries differ from the reference decoder");
    assert_eq!(r.is_ok(), ok, "result differs from the reference ({r:?})");

    // 3. Re-decoding the delivered prefix with a limit cannot fail.
    if !got.is_empty() {
        let n = got.len() as u64;
        let mut again = Vec::new();
        decode_block(&block, Some(n), |i, v| {
            again.push(entry(i, v));
            Ok(())
        })
        .expect("re-decoding entries that decoded once must succeed");
        assert_eq!(again, got);

        // 4. A callback error stops decoding at once and is passed on.
        let stop = n / 2;
        let mut calls = 0u64;
        let r = decode_block(&block, None, |_, _| {
            calls += 1;
            if calls > stop {
                Err(weightcast::Error::Container("stop".into()))
            } else {
                Ok(())
            }
        });
        assert!(r.is_err(), "callback error swallowed");
        assert_eq!(calls, stop + 1, "decoding went on after a callback error");
    }
});

/// Bit-at-a-time LSB-first reader.
struct Bits<'a> {
    data: &'a [u8],
    pos: u64,
}

impl Bits<'_> {
    fn bit(&mut self) -> Option<u64> {
        let b = *self.data.get((self.pos / 8) as usize)?;
        let v = (b >> (self.pos % 8)) & 1;
        self.pos += 1;
        Some(v as u64)
    }

    fn get(&mut self, n: u64) -> Option<u64> {
        let mut v = 0u64;
        for i in 0..n {
            v |= self.bit()? << i;
        }
        Some(v)
    }

    /// Zeros before the next one; `None` past the end or beyond `limit` zeros.
    fn unary(&mut self, limit: u64) -> Option<u64> {
        let mut q = 0u64;
        loop {
            if self.bit()? == 1 {
                return Some(q);
            }
            q += 1;
            if q > limit {
                return None;
            }
        }
    }
}

/// The block layout of docs/format.md, decoded one bit at a time: the entries
/// delivered before the first error, and whether the block is valid.
fn reference(e: &BlockEntry, stream: &[u8], wb: usize, block_len: u64) -> (Vec<Entry>, bool) {
    let mut out = Vec::new();
    if e.pos_k > MAX_POS_K || e.val_k > MAX_VAL_K || e.changes > block_len {
        return (out, false);
    }
    if e.changes.saturating_mul(e.pos_k as u64 + 2) > stream.len() as u64 * 8 {
        return (out, false);
    }
    let bits = wb as u64 * 8;
    let mask = word_mask(wb);
    let half = 1u64 << (bits - 1);
    let k = e.pos_k as u64;
    let mut r = Bits {
        data: stream,
        pos: 0,
    };
    let mut next = 0u64;
    for _ in 0..e.changes {
        let Some(q) = r.unary(block_len >> k) else {
            return (out, false);
        };
        let Some(low) = r.get(k) else {
            return (out, false);
        };
        let idx = next + ((q << k) | low);
        if idx >= block_len {
            return (out, false);
        }
        next = idx + 1;
        if e.values == ValueCoding::Raw {
            let Some(v) = r.get(bits) else {
                return (out, false);
            };
            out.push((idx, true, v));
            continue;
        }
        let Some(z) = r.unary(64) else {
            return (out, false);
        };
        let width = z + e.val_k as u64;
        if width > 63 {
            return (out, false);
        }
        let (Some(rest), Some(neg)) = (r.get(width), r.get(1)) else {
            return (out, false);
        };
        let m = ((1u64 << width) | rest) - (1u64 << e.val_k) + 1;
        if m > half {
            return (out, false);
        }
        out.push((
            idx,
            false,
            if neg == 1 { m.wrapping_neg() & mask } else { m },
        ));
    }
    // Clean end: fewer than 8 bits left, all zero.
    let total = stream.len() as u64 * 8;
    let left = total - r.pos;
    let clean = left < 8 && r.get(left) == Some(0);
    (out, clean)
}
