//! LSB-first bit streams: the first bit written is bit 0 of byte 0.
//!
//! Hand-written rather than taken from a crate because it is the innermost loop
//! of both encode and decode, and because the reader must be total: every read
//! on untrusted bytes returns `None` at the end of the stream instead of
//! panicking or reading past it.

/// Appends bits to a byte vector.
#[derive(Default)]
pub struct BitWriter {
    out: Vec<u8>,
    acc: u64,
    n: u32,
}

impl BitWriter {
    /// A writer with room for about `bytes` bytes.
    pub fn with_capacity(bytes: usize) -> Self {
        BitWriter {
            out: Vec::with_capacity(bytes),
            acc: 0,
            n: 0,
        }
    }

    /// Writes the low `bits` bits of `value` (`bits <= 64`; higher bits of
    /// `value` must be zero).
    #[inline]
    pub fn put(&mut self, value: u64, bits: u32) {
        debug_assert!(bits <= 64);
        debug_assert!(bits == 64 || value >> bits == 0);
        if bits == 0 {
            return;
        }
        self.acc |= value << self.n;
        let total = self.n + bits;
        if total >= 64 {
            self.out.extend_from_slice(&self.acc.to_le_bytes());
            // Bits of `value` that did not fit in the flushed word.
            self.acc = if self.n == 0 {
                0
            } else {
                value >> (64 - self.n)
            };
            self.n = total - 64;
        } else {
            self.n = total;
        }
    }

    /// Writes `count` zero bits.
    #[inline]
    pub fn put_zeros(&mut self, mut count: u64) {
        while count >= 32 {
            self.put(0, 32);
            count -= 32;
        }
        self.put(0, count as u32);
    }

    /// Writes `q` in unary: `q` zero bits, then a one bit.
    #[inline]
    pub fn put_unary(&mut self, q: u64) {
        if q < 63 {
            self.put(1u64 << q, q as u32 + 1);
        } else {
            self.put_zeros(q);
            self.put(1, 1);
        }
    }

    /// Number of bits written so far.
    pub fn bit_len(&self) -> u64 {
        self.out.len() as u64 * 8 + self.n as u64
    }

    /// Pads the last byte with zero bits and returns the bytes.
    pub fn finish(mut self) -> Vec<u8> {
        let bytes = self.n.div_ceil(8) as usize;
        self.out.extend_from_slice(&self.acc.to_le_bytes()[..bytes]);
        self.out
    }
}

/// An LSB-first bit writer for the encoder's hot loop: [`FastWriter::put56`]
/// appends a code of up to 56 bits without a data-dependent branch (it always
/// stores the whole 64-bit accumulator and advances by the whole bytes it
/// holds). The caller reserves room with [`FastWriter::reserve`] first; the
/// stream equals what [`BitWriter`] writes for the same calls.
#[derive(Default)]
pub struct FastWriter {
    /// Bytes `..pos` are final; `pos..pos + 8` may hold scratch.
    buf: Vec<u8>,
    pos: usize,
    /// Pending bits (fewer than 8 between calls).
    acc: u64,
    n: u32,
}

impl FastWriter {
    /// Makes room for `bytes` more bytes of codes through [`FastWriter::put56`].
    #[inline]
    pub fn reserve(&mut self, bytes: usize) {
        let need = self.pos + bytes + 16;
        if self.buf.len() < need {
            self.buf.resize(need.max(self.buf.len() * 2), 0);
        }
    }

    /// Appends the low `bits` bits of `value` (`bits <= 56`, higher bits of
    /// `value` zero). Needs 8 reserved bytes.
    #[inline(always)]
    pub fn put56(&mut self, value: u64, bits: u32) {
        debug_assert!(bits <= 56 && (bits == 56 || value >> bits == 0) && value >> 56 == 0);
        self.acc |= value << self.n;
        self.n += bits;
        self.buf[self.pos..self.pos + 8].copy_from_slice(&self.acc.to_le_bytes());
        let whole = self.n >> 3;
        self.pos += whole as usize;
        // `whole` ≤ 7, so the shift is below 64.
        self.acc >>= whole * 8;
        self.n &= 7;
    }

    /// Appends the low `bits` bits of `value`, any `bits <= 64`, reserving room
    /// itself (the slow path).
    #[inline(never)]
    pub fn put(&mut self, value: u64, bits: u32) {
        self.reserve(16);
        if bits > 32 {
            self.put56(value & 0xffff_ffff, 32);
            self.put56(value >> 32, bits - 32);
        } else {
            self.put56(value, bits);
        }
    }

    /// Appends `q` in unary (`q` zero bits, then a one), any `q`.
    #[inline(never)]
    pub fn put_unary(&mut self, mut q: u64) {
        while q >= 48 {
            self.put(0, 48);
            q -= 48;
        }
        self.put(1u64 << q, q as u32 + 1);
    }

    /// The writer's bytes, position, pending bits and their count, for a
    /// hot loop that keeps the last three in registers and stores them back.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub(crate) fn parts(&mut self) -> (&mut Vec<u8>, &mut usize, &mut u64, &mut u32) {
        (&mut self.buf, &mut self.pos, &mut self.acc, &mut self.n)
    }

    /// Number of bits written so far.
    pub fn bit_len(&self) -> u64 {
        self.pos as u64 * 8 + self.n as u64
    }

    /// A writer over `buf`, whose bytes it overwrites from the start (a
    /// buffer kept between blocks: room already made is not zeroed again).
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub(crate) fn over(buf: Vec<u8>) -> FastWriter {
        FastWriter {
            buf,
            ..FastWriter::default()
        }
    }

    /// Pads the last byte with zero bits and returns the buffer and the
    /// length of the stream at its start (the rest is scratch, kept as room
    /// for [`FastWriter::over`]).
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub(crate) fn finish_over(mut self) -> (Vec<u8>, usize) {
        self.reserve(8);
        let end = self.pos + self.n.div_ceil(8) as usize;
        self.buf[self.pos..self.pos + 8].copy_from_slice(&self.acc.to_le_bytes());
        (self.buf, end)
    }

    /// Pads the last byte with zero bits and returns the bytes.
    pub fn finish(mut self) -> Vec<u8> {
        self.reserve(8);
        let end = self.pos + self.n.div_ceil(8) as usize;
        self.buf[self.pos..self.pos + 8].copy_from_slice(&self.acc.to_le_bytes());
        self.buf.truncate(end);
        self.buf
    }
}

/// The Rice parameter whose estimated length `n·(k+1) + S/2^k −
/// n·(1 − 2^−k)/2` for `n` gaps summing to `sum` is smallest (`k` up to `max_k`).
pub(crate) fn rice_guess(n: u64, sum: u64, max_k: u32) -> u32 {
    if n == 0 {
        return 0;
    }
    let est = |k: u32| {
        let (n, p) = (n as f64, (1u64 << k) as f64);
        n * (k as f64 + 1.0) + sum as f64 / p - n * (1.0 - 1.0 / p) / 2.0
    };
    (0..=max_k)
        .min_by(|&a, &b| est(a).total_cmp(&est(b)))
        .expect("non-empty range")
}

/// The Rice code of `g` with parameter `k` (from the lowest bit: `g >> k`
/// zeros, a one, the low `k` bits of `g`) and its
/// length, when that length is at most `room` bits (`room` ≤ 56).
#[inline(always)]
pub(crate) fn rice_code(g: u64, k: u32, room: u32) -> Option<(u64, u32)> {
    let q = g >> k;
    if q + 1 + k as u64 > room as u64 {
        return None;
    }
    let code = (1u64 << q) | ((g & ((1u64 << k) - 1)) << (q + 1));
    Some((code, q as u32 + 1 + k))
}

/// Writes `g` in Rice code with parameter `k`, then the low `extra` bits of
/// `tail` (`extra` ≤ 8); one append when it fits.
#[inline(always)]
pub(crate) fn put_rice(w: &mut FastWriter, g: u64, k: u32, (tail, extra): (u64, u32)) {
    if let Some((code, len)) = rice_code(g, k, 56 - extra) {
        w.reserve(8);
        w.put56(code | (tail << len), len + extra);
    } else {
        let q = g >> k;
        w.put_unary(q);
        w.put(g & ((1u64 << k) - 1), k);
        w.put(tail, extra);
    }
}

/// The 64 bits of `stream` from bit `at` on (at least 57 of them from the
/// stream), when the 8 bytes holding bit `at` are all in it.
#[inline(always)]
pub(crate) fn window(stream: &[u8], at: u64) -> Option<u64> {
    let byte = (at >> 3) as usize;
    let chunk = stream.get(byte..byte + 8)?;
    Some(u64::from_le_bytes(chunk.try_into().expect("8 bytes")) >> (at & 7))
}

/// Reads bits from a byte slice; every read is checked against the end.
pub struct BitReader<'a> {
    data: &'a [u8],
    pos: usize,
    acc: u64,
    n: u32,
}

impl<'a> BitReader<'a> {
    /// A reader over `data`.
    pub fn new(data: &'a [u8]) -> Self {
        BitReader {
            data,
            pos: 0,
            acc: 0,
            n: 0,
        }
    }

    #[inline(always)]
    fn refill(&mut self) {
        if self.pos + 8 <= self.data.len() {
            let w = u64::from_le_bytes(
                self.data[self.pos..self.pos + 8]
                    .try_into()
                    .expect("8 bytes"),
            );
            let take = (63 - self.n) / 8; // whole bytes that fit
            if take > 0 {
                let bits = take * 8;
                self.acc |= (w & ((1u64 << bits) - 1)) << self.n;
                self.n += bits;
                self.pos += take as usize;
            }
        } else {
            while self.n <= 56 && self.pos < self.data.len() {
                self.acc |= (self.data[self.pos] as u64) << self.n;
                self.n += 8;
                self.pos += 1;
            }
        }
    }

    /// Reads `bits` bits (`bits <= 64`), or `None` past the end.
    #[inline]
    pub fn get(&mut self, bits: u32) -> Option<u64> {
        if bits == 0 {
            return Some(0);
        }
        if bits > 56 {
            let lo = self.get(32)?;
            let hi = self.get(bits - 32)?;
            return Some(lo | (hi << 32));
        }
        if self.n < bits {
            self.refill();
            if self.n < bits {
                return None;
            }
        }
        let v = self.acc & ((1u64 << bits) - 1);
        self.acc >>= bits;
        self.n -= bits;
        Some(v)
    }

    /// Reads a unary number (zeros terminated by a one). Returns `None` past the
    /// end or when more than `limit` zeros are seen.
    #[inline]
    pub fn unary(&mut self, limit: u64) -> Option<u64> {
        let mut count = 0u64;
        loop {
            if self.acc == 0 {
                count += self.n as u64;
                self.n = 0;
                if count > limit {
                    return None;
                }
                self.refill();
                if self.n == 0 {
                    return None;
                }
                continue;
            }
            let tz = self.acc.trailing_zeros();
            count += tz as u64;
            if count > limit {
                return None;
            }
            self.acc >>= tz;
            self.acc >>= 1;
            self.n -= tz + 1;
            return Some(count);
        }
    }

    /// Makes at least 57 bits available in [`BitReader::peek`] when the stream
    /// still has them.
    #[inline]
    pub fn ensure(&mut self) {
        if self.n < 57 {
            self.refill();
        }
    }

    /// The buffered bits (LSB = next bit) and how many of them are valid; bits
    /// above the valid count are zero.
    #[inline]
    pub fn peek(&self) -> (u64, u32) {
        (self.acc, self.n)
    }

    /// Drops `bits` buffered bits (`bits` ≤ the valid count from [`BitReader::peek`]).
    #[inline]
    pub fn consume(&mut self, bits: u32) {
        debug_assert!(bits <= self.n);
        self.acc = if bits >= 64 { 0 } else { self.acc >> bits };
        self.n -= bits;
    }

    /// True when fewer than 8 bits remain and all of them are zero padding.
    pub fn at_clean_end(&self) -> bool {
        self.pos == self.data.len() && self.n < 8 && self.acc == 0
    }

    /// Bits not yet consumed (including zero padding of the last byte).
    pub fn remaining_bits(&self) -> u64 {
        (self.data.len() - self.pos) as u64 * 8 + self.n as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[derive(Debug, Clone)]
    enum Op {
        Bits(u64, u32),
        Unary(u64),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (any::<u64>(), 0u32..=64)
                .prop_map(|(v, b)| Op::Bits(if b == 64 { v } else { v & ((1u64 << b) - 1) }, b)),
            (0u64..300).prop_map(Op::Unary),
        ]
    }

    proptest! {
        #[test]
        fn round_trip(ops in proptest::collection::vec(op(), 0..200)) {
            let mut w = BitWriter::default();
            for o in &ops {
                match *o {
                    Op::Bits(v, b) => w.put(v, b),
                    Op::Unary(q) => w.put_unary(q),
                }
            }
            let bits = w.bit_len();
            let bytes = w.finish();
            prop_assert_eq!(bytes.len() as u64, bits.div_ceil(8));
            let mut r = BitReader::new(&bytes);
            for o in &ops {
                match *o {
                    Op::Bits(v, b) => prop_assert_eq!(r.get(b), Some(v)),
                    Op::Unary(q) => prop_assert_eq!(r.unary(u64::MAX), Some(q)),
                }
            }
            prop_assert!(r.remaining_bits() < 8);
        }
    }

    proptest! {
        #[test]
        fn fast_writer_writes_the_same_stream(ops in proptest::collection::vec(op(), 0..200)) {
            let mut w = BitWriter::default();
            let mut f = FastWriter::default();
            for o in &ops {
                match *o {
                    Op::Bits(v, b) => {
                        w.put(v, b);
                        if b <= 56 {
                            f.reserve(8);
                            f.put56(v, b);
                        } else {
                            f.put(v, b);
                        }
                    }
                    Op::Unary(q) => {
                        w.put_unary(q);
                        f.put_unary(q);
                    }
                }
            }
            prop_assert_eq!(w.bit_len(), f.bit_len());
            prop_assert_eq!(w.finish(), f.finish());
        }
    }

    #[test]
    fn reads_past_end_fail() {
        let mut r = BitReader::new(&[0xff]);
        assert_eq!(r.get(8), Some(0xff));
        assert_eq!(r.get(1), None);
        let mut r = BitReader::new(&[0, 0, 0]);
        assert_eq!(r.unary(u64::MAX), None);
        let mut r = BitReader::new(&[0, 0, 0, 0x80]);
        assert_eq!(r.unary(10), None);
        let mut r = BitReader::new(&[0, 0, 0, 0x80]);
        assert_eq!(r.unary(100), Some(31));
    }
}
