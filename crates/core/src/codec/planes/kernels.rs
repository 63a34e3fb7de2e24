//! The plane kernels (split words into byte planes, join them back) and one
//! worker's zstd state, compressing and decoding a chunk.

use std::ops::Range;

use crate::error::{Error, Result};

/// Words per block of the plane kernels: fixed-size inner loops that the
/// compiler turns into byte shuffles.
const BLOCK: usize = 16;

/// Splits `src` (whole `W`-byte words) into `W` planes of `n` bytes each,
/// plane `p` at `planes[p·n..(p+1)·n]`.
fn split<const W: usize>(src: &[u8], planes: &mut [u8]) {
    let n = src.len() / W;
    let blocks = n / BLOCK;
    for b in 0..blocks {
        let w = &src[b * BLOCK * W..(b + 1) * BLOCK * W];
        for p in 0..W {
            let dst = &mut planes[p * n + b * BLOCK..p * n + (b + 1) * BLOCK];
            for k in 0..BLOCK {
                dst[k] = w[k * W + p];
            }
        }
    }
    for i in blocks * BLOCK..n {
        for p in 0..W {
            planes[p * n + i] = src[i * W + p];
        }
    }
}

/// Interleaves `W` planes of equal length back into words.
fn join<const W: usize>(planes: &[&[u8]], dst: &mut [u8]) {
    let n = dst.len() / W;
    let planes: [&[u8]; W] = std::array::from_fn(|p| &planes[p][..n]);
    let blocks = n / BLOCK;
    for b in 0..blocks {
        let out = &mut dst[b * BLOCK * W..(b + 1) * BLOCK * W];
        let src: [&[u8]; W] = std::array::from_fn(|p| &planes[p][b * BLOCK..(b + 1) * BLOCK]);
        for k in 0..BLOCK {
            for p in 0..W {
                out[k * W + p] = src[p][k];
            }
        }
    }
    for i in blocks * BLOCK..n {
        for p in 0..W {
            dst[i * W + p] = planes[p][i];
        }
    }
}

/// Compression state of one worker.
pub(super) struct Encoder {
    zstd: zstd::bulk::Compressor<'static>,
    planes: Vec<u8>,
    /// The encoded chunk is `out[..used]` (`out` only grows: no zero-fill per
    /// chunk).
    pub(super) out: Vec<u8>,
    pub(super) used: usize,
    pub(super) lens: Vec<u64>,
}

/// Bytes at the start of a plane compressed first to decide whether the whole
/// plane is worth compressing.
const PROBE: usize = 32 << 10;

impl Encoder {
    pub(super) fn new(level: i32) -> Result<Self> {
        use zstd::zstd_safe::CParameter;
        let err = |e| Error::Config(format!("zstd level {level}: {e}"));
        let mut zstd = zstd::bulk::Compressor::new(level).map_err(err)?;
        // Byte planes of weights are literals: few symbols, skewed (the
        // exponent), and no long repeats. The smallest hash table and the
        // longest minimum match make zstd skip the short matches it would
        // otherwise find everywhere, which cost time and, worse, ratio: on
        // the high byte of real bf16 weights 2.95 -> 2.73 bits per byte and
        // 2.5x faster (docs/benchmarks.md, "Compressed anchors").
        zstd.set_parameter(CParameter::HashLog(6)).map_err(err)?;
        zstd.set_parameter(CParameter::MinMatch(7)).map_err(err)?;
        Ok(Encoder {
            zstd,
            planes: Vec::new(),
            out: Vec::new(),
            used: 0,
            lens: Vec::new(),
        })
    }

    /// Encodes one chunk (`src`: whole `wb`-byte words) into `out` and `lens`.
    pub(super) fn chunk(&mut self, wb: usize, src: &[u8]) {
        let n = src.len() / wb;
        if self.out.len() < src.len() {
            self.out.resize(src.len(), 0);
        }
        self.used = 0;
        self.lens.clear();
        if wb > 1 {
            self.planes.resize(src.len(), 0);
            crate::with_word_width!(wb, W => split::<W>(src, &mut self.planes));
        }
        for p in 0..wb {
            let plane = if wb == 1 {
                src
            } else {
                &self.planes[p * n..(p + 1) * n]
            };
            let at = self.used;
            // A frame must come out strictly shorter than the plane (that is
            // how readers tell it from a raw plane); zstd fails when it does
            // not fit, and the plane is stored raw. A plane whose first
            // PROBE bytes do not shrink by 2% (the low byte of bf16: mantissa)
            // is stored raw without trying the rest.
            let worth = n <= PROBE || {
                let probe = &plane[..PROBE];
                let room = &mut self.out[at..at + PROBE * 49 / 50];
                self.zstd.compress_to_buffer(probe, room).is_ok()
            };
            let frame = match n {
                0 | 1 => None,
                _ if !worth => None,
                _ => self
                    .zstd
                    .compress_to_buffer(plane, &mut self.out[at..at + n - 1])
                    .ok(),
            };
            let len = match frame {
                Some(len) => len,
                None => {
                    self.out[at..at + n].copy_from_slice(plane);
                    n
                }
            };
            self.used += len;
            self.lens.push(len as u64);
        }
    }
}

/// Decompression state of one worker.
struct Decoder {
    zstd: zstd::bulk::Decompressor<'static>,
    scratch: Vec<u8>,
}

impl Decoder {
    fn new() -> Result<Self> {
        Ok(Decoder {
            zstd: zstd::bulk::Decompressor::new()
                .map_err(|e| Error::Config(format!("zstd decompressor: {e}")))?,
            scratch: Vec::new(),
        })
    }
}

thread_local! {
    static DECODER: std::cell::RefCell<Option<Decoder>> = const { std::cell::RefCell::new(None) };
}

/// Decodes one chunk whose table entry is `lens` (already validated: one
/// length per plane, each at most the chunk's word count) from `src` (exactly
/// its stored bytes) into `dst` (exactly its decoded bytes).
fn decode_chunk_into(
    dec: &mut Decoder,
    name: &str,
    chunk: usize,
    wb: usize,
    lens: &[u64],
    src: &[u8],
    dst: &mut [u8],
) -> Result<()> {
    let n = dst.len() / wb;
    let bad = |p: usize, what: String| {
        Error::tensor(
            name,
            format!("chunk {chunk} plane {p}: {what}; the object is damaged, fetch it again"),
        )
    };
    let frames = lens.iter().filter(|&&l| l as usize != n).count();
    dec.scratch.resize(if wb == 1 { 0 } else { frames * n }, 0);
    let (mut at, mut slot) = (0usize, 0usize);
    let mut ranges: Vec<(bool, Range<usize>)> = Vec::with_capacity(wb);
    for (p, &len) in lens.iter().enumerate() {
        let len = len as usize;
        let stored = &src[at..at + len];
        at += len;
        if len == n {
            ranges.push((false, at - len..at));
            continue;
        }
        // Exactly one frame, that decodes to exactly n bytes (never more: the
        // output buffer is the bound).
        match zstd::zstd_safe::find_frame_compressed_size(stored) {
            Ok(k) if k == len => {}
            Ok(k) => return Err(bad(p, format!("{len} bytes hold a {k}-byte zstd frame"))),
            Err(c) => {
                return Err(bad(
                    p,
                    format!("not a zstd frame ({})", zstd::zstd_safe::get_error_name(c)),
                ));
            }
        }
        let out = if wb == 1 {
            &mut dst[..]
        } else {
            &mut dec.scratch[slot * n..(slot + 1) * n]
        };
        match dec.zstd.decompress_to_buffer(stored, out) {
            Ok(k) if k == n => {}
            Ok(k) => return Err(bad(p, format!("decodes to {k} bytes, {n} expected"))),
            Err(e) => return Err(bad(p, format!("corrupt zstd frame ({e})"))),
        }
        ranges.push((true, slot * n..(slot + 1) * n));
        slot += 1;
    }
    if wb == 1 {
        if !ranges[0].0 {
            dst.copy_from_slice(src);
        }
        return Ok(());
    }
    let planes: Vec<&[u8]> = ranges
        .iter()
        .map(|(frame, r)| {
            if *frame {
                &dec.scratch[r.clone()]
            } else {
                &src[r.clone()]
            }
        })
        .collect();
    crate::with_word_width!(wb, W => join::<W>(&planes, dst));
    Ok(())
}

/// [`decode_chunk_into`] with this thread's decoder.
pub(super) fn decode_chunk_local(
    name: &str,
    chunk: usize,
    wb: usize,
    lens: &[u64],
    src: &[u8],
    dst: &mut [u8],
) -> Result<()> {
    DECODER.with(|cell| {
        let mut slot = cell.borrow_mut();
        if slot.is_none() {
            *slot = Some(Decoder::new()?);
        }
        let dec = slot.as_mut().expect("just set");
        decode_chunk_into(dec, name, chunk, wb, lens, src, dst)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::planes::LEVEL;

    #[test]
    fn split_and_join_are_inverse_for_every_width() {
        for wb in [1usize, 2, 4, 8] {
            for n in [0usize, 1, 3, 17, 64] {
                let src: Vec<u8> = (0..n * wb).map(|i| (i * 7 + 3) as u8).collect();
                let mut planes = vec![0u8; src.len()];
                crate::with_word_width!(wb, W => split::<W>(&src, &mut planes));
                for p in 0..wb {
                    for i in 0..n {
                        assert_eq!(planes[p * n + i], src[i * wb + p]);
                    }
                }
                let views: Vec<&[u8]> = (0..wb).map(|p| &planes[p * n..(p + 1) * n]).collect();
                let mut back = vec![0u8; src.len()];
                crate::with_word_width!(wb, W => join::<W>(&views, &mut back));
                assert_eq!(back, src);
            }
        }
    }

    #[test]
    fn incompressible_planes_are_stored_raw_and_frames_are_shorter() {
        let mut enc = Encoder::new(LEVEL).unwrap();
        let mut x = 1u64;
        // Low byte random, high byte constant.
        let src: Vec<u8> = (0..4096)
            .flat_map(|_| {
                x = crate::digest::fmix64(x.wrapping_add(1));
                [x as u8, 0x3c]
            })
            .collect();
        enc.chunk(2, &src);
        assert_eq!(enc.lens[0], 4096, "random plane stored raw");
        assert!(
            enc.lens[1] < 100,
            "constant plane compressed: {}",
            enc.lens[1]
        );
        let mut dec = Decoder::new().unwrap();
        let mut back = vec![0u8; src.len()];
        decode_chunk_into(
            &mut dec,
            "t",
            0,
            2,
            &enc.lens,
            &enc.out[..enc.used],
            &mut back,
        )
        .unwrap();
        assert_eq!(back, src);
        // One-word chunks are always raw.
        enc.chunk(4, &[1, 2, 3, 4]);
        assert_eq!(enc.lens, vec![1, 1, 1, 1]);
    }
}
