//! The `compact2` block decoder (`compact::decode_block` on a [`Block`] with a
//! context) and apply (`compact::apply_block_members`, `undo_block`) on
//! untrusted streams and contexts.
//!
//! Input layout (`examples/fuzz_seeds.rs` writes seeds in it):
//!
//! | bytes | meaning |
//! |-------|---------|
//! | 0     | flags: bit 0 = raw values (else step), bits 1–2 = word width 1/2/4/8, bit 3 = "huge" `changes` (high 48 bits set), bit 4 = `pos_k` 1, bit 5 = `val_k` 1 (both must be rejected), bit 6 = integer keys (else sign-magnitude) |
//! | 1–2   | `changes`, u16 LE |
//! | 3–5   | block length in words, u24 LE, taken modulo 2^16 + 1 |
//! | 6–7   | `M`, u16 LE: context members described |
//! | 8..8+2M | the members, u16 LE each: `v >> 2` = gap (index = previous index + 1 + gap, from −1), `v & 3` = `neg << 1 \| big`; members at or past the block's end are dropped |
//! | 8+2M.. | the block's stream |
//!
//! Checks:
//! - the callback runs at most `changes` times (exactly that many on `Ok`,
//!   never on `Err`: a `compact2` block is decoded whole first), with strictly
//!   ascending indices below the block length, raw values within the word and
//!   steps non-zero and within the word;
//! - the result and the entries equal those of a slow bit-by-bit reference
//!   decoder written from `docs/format.md` §6.3 (the differential check that
//!   validates the spec);
//! - decoding again with a `limit` yields a prefix; a callback error stops
//!   decoding and is returned;
//! - applying the block to a pseudo-random base succeeds exactly when the
//!   reference accepts it (raw blocks: and every new word differs from the
//!   old one), gives the reference's words, digest change and next-context
//!   members, and `undo_block` restores the base after a success and after
//!   a failure (all-or-nothing).

#![no_main]

use libfuzzer_sys::fuzz_target;
use weightcast::codec::compact::context::{Member, block_checksum};
use weightcast::codec::compact::{
    Block, BlockUndo, Ctx, NextMembers, Value, apply_block_members, decode_block, undo_block,
};
use weightcast::digest::TensorSeed;
use weightcast::dtype::KeyKind;
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

fn mask_of(wb: usize) -> u64 {
    if wb == 8 {
        u64::MAX
    } else {
        (1u64 << (8 * wb)) - 1
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
    let kind = if flags & 64 != 0 {
        KeyKind::Identity
    } else {
        KeyKind::SignMagnitude
    };
    let m_count = u16::from_le_bytes([data[6], data[7]]) as usize;
    let m_end = (HEAD + 2 * m_count).min(data.len());
    let mut members: Vec<Member> = Vec::new();
    let mut prev: i64 = -1;
    for pair in data[HEAD..m_end].chunks_exact(2) {
        let v = u16::from_le_bytes([pair[0], pair[1]]) as i64;
        let i = prev + 1 + (v >> 2);
        if i as u64 >= block_len {
            break;
        }
        members.push(((i as u32) << 2) | (v as u32 & 3));
        prev = i;
    }
    let stream = &data[m_end..];
    let e = BlockEntry {
        changes,
        pos_k: (flags >> 4) & 1,
        values: if raw {
            ValueCoding::Raw
        } else {
            ValueCoding::Step
        },
        val_k: (flags >> 5) & 1,
        bytes: stream.len() as u64,
    };
    let mask = mask_of(wb);
    let half = 1u64 << (wb * 8 - 1);
    let block = Block {
        tensor: "t",
        index: 0,
        entry: &e,
        stream,
        wb,
        words: block_len,
        context: Some(&members),
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
    } else {
        assert!(got.is_empty(), "entries delivered from a block that fails");
    }

    // 2. Differential check against the reference decoder.
    let reference = reference(&e, stream, wb, block_len, &members);
    assert_eq!(
        r.is_ok(),
        reference.is_some(),
        "result differs from the reference ({r:?})"
    );
    let next = if let Some((want, next)) = reference {
        assert_eq!(got, want, "entries differ from the reference decoder");
        Some(next)
    } else {
        None
    };

    // 3. A limit delivers a prefix; a callback error stops decoding.
    if !got.is_empty() {
        let n = got.len() as u64;
        let mut again = Vec::new();
        decode_block(&block, Some(n / 2), |i, v| {
            again.push(entry(i, v));
            Ok(())
        })
        .expect("decoding a valid block with a limit must succeed");
        assert_eq!(again[..], got[..(n / 2) as usize]);

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

    // 4. Apply to a pseudo-random base, against the reference's result; undo.
    let salt = data.iter().fold(0x9e37_79b9_7f4a_7c15u64, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    });
    let mut base = vec![0u8; block_len as usize * wb];
    for i in 0..block_len {
        write(&mut base, wb, i as usize, splitmix(i ^ salt));
    }
    let seed = TensorSeed(salt);
    let ctx = Ctx {
        kind,
        seed,
        first: 0,
    };
    let expected = next.and_then(|next_members| {
        let mut blk = base.clone();
        let mut dig = 0u64;
        for &(i, is_raw, v) in &got {
            let old = read(&base, wb, i as usize);
            let new = if is_raw {
                v
            } else {
                unkey(kind, wb, key(kind, wb, old).wrapping_add(v) & mask)
            };
            if new == old {
                return None;
            }
            write(&mut blk, wb, i as usize, new);
            dig = dig.wrapping_add(seed.change(i, old, new));
        }
        Some((blk, dig, next_members))
    });
    let mut blk = base.clone();
    let mut undo = BlockUndo::default();
    let mut out = NextMembers::new(0x5eed);
    let applied = apply_block_members(&block, ctx, &mut blk, &mut undo, &mut out);
    match (&applied, &expected) {
        (Ok(dig), Some((want_blk, want_dig, want_members))) => {
            assert!(blk == *want_blk, "applied words differ from the reference");
            assert_eq!(*dig, *want_dig, "digest change differs");
            assert_eq!(&out.members, want_members, "next-context members differ");
            let want_sum = block_checksum(0x5eed, block.index as u64, want_members);
            assert_eq!(out.checksum, want_sum, "next-context checksum differs");
            assert_eq!(undo.applied, changes);
        }
        (Err(_), None) => {
            assert!(out.members.is_empty(), "members left after a failed apply");
        }
        _ => panic!(
            "apply result {:?} but the reference {}",
            applied.as_ref().map(|_| ()),
            if expected.is_some() {
                "accepts"
            } else {
                "refuses"
            }
        ),
    }
    undo_block(&block, kind, &mut blk, &undo);
    assert!(
        blk == base,
        "undo_block did not restore the base (apply {})",
        if applied.is_ok() {
            "succeeded"
        } else {
            "failed"
        }
    );
});

fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn read(b: &[u8], wb: usize, i: usize) -> u64 {
    let mut w = [0u8; 8];
    w[..wb].copy_from_slice(&b[i * wb..i * wb + wb]);
    u64::from_le_bytes(w)
}

fn write(b: &mut [u8], wb: usize, i: usize, w: u64) {
    b[i * wb..i * wb + wb].copy_from_slice(&w.to_le_bytes()[..wb]);
}

/// docs/format.md §2.
fn key(kind: KeyKind, wb: usize, w: u64) -> u64 {
    let (s, m) = (1u64 << (8 * wb - 1), mask_of(wb));
    match kind {
        KeyKind::Identity => w,
        KeyKind::SignMagnitude if w & s != 0 => !w & m,
        KeyKind::SignMagnitude => w | s,
    }
}

fn unkey(kind: KeyKind, wb: usize, k: u64) -> u64 {
    let (s, m) = (1u64 << (8 * wb - 1), mask_of(wb));
    match kind {
        KeyKind::Identity => k,
        KeyKind::SignMagnitude if k & s != 0 => k & !s,
        KeyKind::SignMagnitude => !k & m,
    }
}

// ---------------------------------------------------------------------------
// The reference decoder, written from docs/format.md §6.3 (not from the code).

/// Bit-at-a-time LSB-first reader over one region.
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

    /// `unary(q)`: zeros before the next one (`None` past the end).
    fn unary(&mut self) -> Option<u64> {
        let mut q = 0u64;
        while self.bit()? == 0 {
            q += 1;
        }
        Some(q)
    }

    /// `rice_k`: a value below `space`, or `None` (an over-long quotient
    /// is refused as soon as it passes `space >> k`, as it names a value
    /// ≥ `space` anyway).
    fn rice_below(&mut self, k: u64, space: u64) -> Option<u64> {
        let mut q = 0u64;
        while self.bit()? == 0 {
            q += 1;
            if q > space >> k {
                return None;
            }
        }
        let v = (q << k) | self.get(k)?;
        Some(v)
    }

    /// `eg_k`: `x` with `z + k ≤ 62`.
    fn eg(&mut self, k: u64) -> Option<u64> {
        let z = self.unary()?;
        if z + k > 62 {
            return None;
        }
        let r = self.get(z + k)?;
        Some((1u64 << (z + k)) + r - (1u64 << k))
    }

    /// Fewer than 8 bits left, all zero.
    fn clean_end(&mut self) -> bool {
        let left = self.data.len() as u64 * 8 - self.pos;
        left < 8 && self.get(left) == Some(0)
    }
}

/// A LEB128 varint of at most 10 bytes, the 10th at most 1.
fn varint(s: &[u8], at: &mut usize) -> Option<u64> {
    let mut v = 0u64;
    for i in 0..10 {
        let b = *s.get(*at)?;
        *at += 1;
        if i == 9 && b > 1 {
            return None;
        }
        v |= ((b & 0x7f) as u64) << (7 * i);
        if b & 0x80 == 0 {
            return Some(v);
        }
    }
    None
}

fn byte(s: &[u8], at: &mut usize) -> Option<u64> {
    let b = *s.get(*at)?;
    *at += 1;
    Some(b as u64)
}

#[derive(Default, Clone, Copy)]
struct Head {
    n: u64,
    k: u64,
    e: u64,
    ke: u64,
    ve: u64,
    /// 0: a sign bit per entry; t + 1: a list of t set signs.
    l: u64,
    ko: u64,
    len: u64,
}

/// The block's entries in ascending index order and the members of the
/// next context, or `None` when a reader must reject the block.
fn reference(
    e: &BlockEntry,
    stream: &[u8],
    wb: usize,
    words: u64,
    members: &[Member],
) -> Option<(Vec<Entry>, Vec<Member>)> {
    let raw = e.values == ValueCoding::Raw;
    if e.pos_k != 0 || e.val_k != 0 {
        return None;
    }
    if e.changes == 0 {
        return stream.is_empty().then(|| (Vec::new(), Vec::new()));
    }
    let bits = 8 * wb as u64;
    let mask = mask_of(wb);
    let half = 1u64 << (bits - 1);
    // The classes' member lists: members without and with `big`.
    let l1: Vec<Member> = members.iter().copied().filter(|m| m & 1 == 0).collect();
    let l2: Vec<Member> = members.iter().copied().filter(|m| m & 1 == 1).collect();
    let space = [words, l1.len() as u64, l2.len() as u64];
    // Prologue.
    let mut at = 0usize;
    let mut heads = [Head::default(); 3];
    for (c, h) in heads.iter_mut().enumerate() {
        h.n = varint(stream, &mut at)?;
        if h.n == 0 {
            continue;
        }
        if h.n > space[c] {
            return None;
        }
        h.k = byte(stream, &mut at)?;
        if h.k > 40 {
            return None;
        }
        if !raw {
            h.e = varint(stream, &mut at)?;
            if h.e > h.n {
                return None;
            }
            if h.e > 0 {
                h.ke = byte(stream, &mut at)?;
                h.ve = byte(stream, &mut at)?;
                if h.ke > 40 || h.ve > 32 {
                    return None;
                }
            }
            h.l = varint(stream, &mut at)?;
            if h.l > 0 && h.l - 1 > h.n {
                return None;
            }
            if h.l >= 2 {
                h.ko = byte(stream, &mut at)?;
                if h.ko > 40 {
                    return None;
                }
            }
        }
        h.len = varint(stream, &mut at)?;
        let sign = if raw { bits } else { u64::from(h.l == 0) };
        let t = h.l.saturating_sub(1);
        let need = h.n as u128 * (h.k + 1 + sign) as u128
            + h.e as u128 * (h.ke + 2 + h.ve) as u128
            + t as u128 * (h.ko + 1) as u128;
        if need > h.len as u128 * 8 {
            return None;
        }
    }
    if heads.iter().map(|h| h.n as u128).sum::<u128>() != e.changes as u128 {
        return None;
    }
    if heads.iter().map(|h| h.len as u128).sum::<u128>() + at as u128 != stream.len() as u128 {
        return None;
    }
    // Regions.
    let mut all: Vec<(u64, bool, u64, Member)> = Vec::new(); // + next member
    for (c, h) in heads.iter().enumerate() {
        if h.n == 0 {
            continue;
        }
        let region = &stream[at..at + h.len as usize];
        at += h.len as usize;
        let mut r = Bits {
            data: region,
            pos: 0,
        };
        let (mut esc, mut listed) = (Vec::new(), Vec::new());
        if !raw {
            let mut prev: i128 = -1;
            for _ in 0..h.e {
                let g = r.rice_below(h.ke, h.n)?;
                let rank = prev + 1 + g as i128;
                if rank >= h.n as i128 {
                    return None;
                }
                prev = rank;
                let m = r.eg(h.ve)? + 2;
                if m > half {
                    return None;
                }
                esc.push((rank as u64, m));
            }
            let mut prev: i128 = -1;
            for _ in 0..h.l.saturating_sub(1) {
                let g = r.rice_below(h.ko, h.n)?;
                let rank = prev + 1 + g as i128;
                if rank >= h.n as i128 {
                    return None;
                }
                prev = rank;
                listed.push(rank as u64);
            }
        }
        let (mut ei, mut li) = (0usize, 0usize);
        let mut prev: i128 = -1;
        for rank in 0..h.n {
            let g = r.rice_below(h.k, space[c])?;
            let p = prev + 1 + g as i128;
            if p >= space[c] as i128 {
                return None;
            }
            prev = p;
            let (i, last_neg) = match c {
                0 => (p as u64, 0),
                1 => (
                    (l1[p as usize] >> 2) as u64,
                    (l1[p as usize] >> 1) as u64 & 1,
                ),
                _ => (
                    (l2[p as usize] >> 2) as u64,
                    (l2[p as usize] >> 1) as u64 & 1,
                ),
            };
            if raw {
                let w = r.get(bits)?;
                all.push((i, true, w, ((i as u32) << 2) | 1));
                continue;
            }
            let sgn = if h.l == 0 {
                r.get(1)?
            } else if listed.get(li) == Some(&rank) {
                li += 1;
                1
            } else {
                0
            };
            let mut mag = 1;
            if let Some(&(er, m)) = esc.get(ei)
                && er == rank
            {
                ei += 1;
                mag = m;
            }
            let neg = sgn ^ last_neg;
            let s = if neg == 1 {
                mag.wrapping_neg() & mask
            } else {
                mag
            };
            let big = u32::from(s != 1 && s != mask);
            let nneg = ((s >> (bits - 1)) & 1) as u32;
            all.push((i, false, s, ((i as u32) << 2) | (nneg << 1) | big));
        }
        if !r.clean_end() {
            return None;
        }
    }
    // A class-0 position that is a member that changed again (class 1 or 2):
    // its word would change twice. (A class-0 position at a member that did
    // not change again changes that word once, and is accepted.)
    let class0 = heads[0].n as usize;
    let again_idx: std::collections::BTreeSet<u64> = all[class0..].iter().map(|x| x.0).collect();
    if all[..class0].iter().any(|x| again_idx.contains(&x.0)) {
        return None;
    }
    all.sort_by_key(|x| x.0);
    assert!(
        all.windows(2).all(|w| w[0].0 < w[1].0),
        "reference: classes 1 and 2 overlap (members not distinct)"
    );
    Some((
        all.iter().map(|x| (x.0, x.1, x.2)).collect(),
        all.iter().map(|x| x.3).collect(),
    ))
}
