//! Compressed anchors: the `planes` encoding (docs/format.md §5.1).
//!
//! Each tensor's words are cut into independent **chunks** of `chunk_words`
//! words (the last one shorter). Within a chunk, byte `p` of every word forms
//! **plane** `p` (`p = 0` the least significant byte); each plane is stored as
//! one zstd frame, or raw when zstd does not make it smaller (the low byte of
//! bf16, mostly mantissa, is close to random; the high byte, sign and
//! exponent, compresses well). Packed and one-byte dtypes have a single plane:
//! their bytes as they are.
//!
//! The object stays a safetensors file: one `U8` tensor `<name>.planes` per
//! source tensor holding its chunks back to back, the usual anchor metadata
//! (`weightcast.tensors` with the digests of the *decoded* tensors) with
//! `weightcast.encoding = planes`, and the chunk table under
//! `weightcast.planes`. A reader needs only the header to locate and decode
//! any chunk, so chunks decode in parallel, from ranged reads, straight into
//! the destination.
//!
//! Writing is streaming: a [`PlanesWriter`] takes tensors in any order, in
//! pieces of any size, compresses whole chunks in parallel batches and writes
//! them to a sink (a spill file), with memory bounded by the batch size. The
//! header depends on the compressed sizes, so it is known only at
//! [`PlanesWriter::finish`]: **the object is the returned prefix followed by
//! everything written to the sink.**
//!
//! Reading: [`PlanesLayout::parse`] needs only the object's first
//! [`prefix_len`] bytes; [`PlanesDecoder`] decodes the chunks that lie inside
//! any window of object bytes (a ranged GET) into the materialized anchor's
//! data section and checks every digest at the end; [`materialize`] writes the
//! plain (`full`) anchor an object stands for, with bounded memory.

use std::collections::BTreeMap;
use std::io::Write;
use std::ops::Range;

use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use crate::digest::{Digest, TensorSeed, words_digest};
use crate::dtype::{Dtype, byte_len, element_count, parse_dtype, word_bytes};
use crate::error::{Error, Result};
use crate::format::{Encoding, Header, Kind, entry_digest, keys};

/// Suffix of the `U8` tensor holding a tensor's chunks.
pub const SUFFIX: &str = ".planes";
/// Words per chunk this writer uses by default (2^20: 2 MiB of bf16).
pub const CHUNK_WORDS: u64 = 1 << 20;
/// Largest `chunk_words` a reader accepts (bounds its per-chunk scratch to
/// 8 · 2^22 bytes per worker).
pub const MAX_CHUNK_WORDS: u64 = 1 << 22;
/// zstd level this writer uses by default.
pub const LEVEL: i32 = 1;
/// A valid zstd frame never expands more than this (a 128 KiB RLE block takes
/// 4 bytes); table entries claiming more are refused before anything is
/// allocated for them.
pub const MAX_FRAME_RATIO: u64 = 1 << 15;
/// Largest header (the JSON after the 8-byte length) a reader accepts; the
/// safetensors limit.
pub const MAX_HEADER: u64 = 100_000_000;

/// The chunk table, the value of `weightcast.planes` (JSON).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlanesTable {
    /// Words per chunk (the last chunk of a tensor may be shorter).
    pub chunk_words: u64,
    /// Tensor name → its chunks in order; each chunk lists the stored length
    /// of each of its planes, plane 0 first. A length equal to the chunk's
    /// word count means the plane is stored raw, a shorter one that it is a
    /// zstd frame.
    pub tensors: BTreeMap<String, Vec<Vec<u64>>>,
}

/// Writer settings.
#[derive(Clone, Copy, Debug)]
pub struct PlanesOptions {
    /// Words per chunk (1 ..= [`MAX_CHUNK_WORDS`]).
    pub chunk_words: u64,
    /// zstd compression level.
    pub level: i32,
    /// Input bytes compressed per parallel batch (at least one chunk, and at
    /// least one chunk per worker thread). The writer holds about three times
    /// this much: the batch, the compressed chunks and the plane scratch.
    pub batch_bytes: usize,
}

impl Default for PlanesOptions {
    fn default() -> Self {
        PlanesOptions {
            chunk_words: CHUNK_WORDS,
            level: LEVEL,
            batch_bytes: 16 << 20,
        }
    }
}

// ---------------------------------------------------------------------------
// Plane kernels.

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
struct Encoder {
    zstd: zstd::bulk::Compressor<'static>,
    planes: Vec<u8>,
    /// The encoded chunk is `out[..used]` (`out` only grows: no zero-fill per
    /// chunk).
    out: Vec<u8>,
    used: usize,
    lens: Vec<u64>,
}

/// Bytes at the start of a plane compressed first to decide whether the whole
/// plane is worth compressing.
const PROBE: usize = 32 << 10;

impl Encoder {
    fn new(level: i32) -> Result<Self> {
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
    fn chunk(&mut self, wb: usize, src: &[u8]) {
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
fn decode_chunk_local(
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

// ---------------------------------------------------------------------------
// Writer.

struct Written {
    name: String,
    dtype: Dtype,
    shape: Vec<usize>,
    chunks: Vec<Vec<u64>>,
    stored: u64,
}

/// The tensor being written.
struct Open {
    idx: usize,
    wb: usize,
    total: u64,
    received: u64,
}

/// A chunk waiting in the batch: its tensor, word width and bytes in `pending`.
#[derive(Clone)]
struct Job {
    tensor: usize,
    wb: usize,
    bytes: Range<usize>,
}

/// What [`PlanesWriter::finish`] returns.
#[derive(Debug)]
pub struct Finished<W> {
    /// The object's first bytes: the 8-byte header length and the header. The
    /// object is this prefix followed by everything written to the sink.
    pub prefix: Vec<u8>,
    /// The sink, with every chunk written to it.
    pub sink: W,
    /// Bytes written to the sink.
    pub data_bytes: u64,
    /// Bytes of the decoded tensors (what a `full` anchor's data section holds).
    pub raw_bytes: u64,
    /// The header as written.
    pub header: Header,
}

/// Streams tensors into a `planes` anchor; see the module documentation.
///
/// Chunks are compressed in parallel batches: a batch collects whole chunks
/// (of one tensor or of many small ones) until it holds about
/// [`PlanesOptions::batch_bytes`], then every chunk of it is compressed at once
/// and written to the sink in order. Pieces of at least one chunk that arrive
/// while no batch is pending are compressed from the caller's slice without a
/// copy.
pub struct PlanesWriter<W: Write> {
    sink: W,
    opts: PlanesOptions,
    written: u64,
    tensors: Vec<Written>,
    open: Option<Open>,
    /// Bytes of the pending batch: `jobs`' chunks, then the open tensor's
    /// bytes not yet cut into a chunk (from `tail`).
    pending: Vec<u8>,
    jobs: Vec<Job>,
    tail: usize,
    workers: Vec<Encoder>,
    /// The source checkpoint's own header metadata, carried along.
    metadata: BTreeMap<String, String>,
}

impl<W: Write> PlanesWriter<W> {
    /// Carries a checkpoint's own header metadata (non-`weightcast.*` keys)
    /// into the object, as raw anchors do.
    pub fn set_metadata(&mut self, metadata: &BTreeMap<String, String>) {
        self.metadata = metadata.clone();
    }

    /// A writer that puts the compressed chunks into `sink`.
    pub fn new(sink: W, opts: PlanesOptions) -> Result<Self> {
        if !(1..=MAX_CHUNK_WORDS).contains(&opts.chunk_words) {
            return Err(Error::Config(format!(
                "planes chunk_words {} is not within 1..={MAX_CHUNK_WORDS}",
                opts.chunk_words
            )));
        }
        // Fail on a bad level now rather than at the first chunk.
        let first = Encoder::new(opts.level)?;
        Ok(PlanesWriter {
            sink,
            opts,
            written: 0,
            tensors: Vec::new(),
            open: None,
            pending: Vec::new(),
            jobs: Vec::new(),
            tail: 0,
            workers: vec![first],
            metadata: BTreeMap::new(),
        })
    }

    /// Starts the next tensor; its bytes follow through [`Self::write`].
    pub fn begin_tensor(&mut self, name: &str, dtype: Dtype, shape: &[usize]) -> Result<()> {
        if let Some(o) = &self.open {
            return Err(Error::tensor(
                &self.tensors[o.idx].name,
                "not ended before the next tensor began",
            ));
        }
        if self.tensors.iter().any(|t| t.name == name) {
            return Err(Error::tensor(name, "duplicate tensor name"));
        }
        let total = byte_len(dtype, shape)
            .ok_or_else(|| Error::tensor(name, "shape overflows or is not byte-aligned"))?;
        self.open = Some(Open {
            idx: self.tensors.len(),
            wb: word_bytes(dtype),
            total: total as u64,
            received: 0,
        });
        self.tensors.push(Written {
            name: name.to_string(),
            dtype,
            shape: shape.to_vec(),
            chunks: Vec::new(),
            stored: 0,
        });
        Ok(())
    }

    /// Chunks a batch collects at most (many small tensors): bounds the
    /// workers, each of which holds a zstd context.
    fn max_jobs() -> usize {
        4 * rayon::current_num_threads().max(16)
    }

    /// Bytes a batch collects before it is compressed.
    fn batch_len(&self, chunk: usize) -> usize {
        self.opts
            .batch_bytes
            .max(chunk * rayon::current_num_threads())
            .max(chunk)
    }

    /// The next bytes of the current tensor (in order; any piece size).
    pub fn write(&mut self, mut data: &[u8]) -> Result<()> {
        let Some(o) = &mut self.open else {
            return Err(Error::Config(
                "planes writer: write without begin_tensor".into(),
            ));
        };
        if o.received + data.len() as u64 > o.total {
            return Err(Error::tensor(
                &self.tensors[o.idx].name,
                format!(
                    "{} bytes written, dtype and shape hold {}",
                    o.received + data.len() as u64,
                    o.total
                ),
            ));
        }
        o.received += data.len() as u64;
        let (idx, wb) = (o.idx, o.wb);
        let chunk = self.opts.chunk_words as usize * wb;
        let batch = self.batch_len(chunk);
        while !data.is_empty() {
            if self.pending.is_empty() && data.len() >= chunk {
                // Whole chunks straight from the caller's slice.
                let take = (data.len() / chunk * chunk).min(batch / chunk * chunk);
                let jobs: Vec<Job> = (0..take / chunk)
                    .map(|k| Job {
                        tensor: idx,
                        wb,
                        bytes: k * chunk..(k + 1) * chunk,
                    })
                    .collect();
                self.run(&data[..take], &jobs)?;
                data = &data[take..];
                continue;
            }
            let take = batch
                .saturating_sub(self.pending.len())
                .max(1)
                .min(data.len());
            self.pending.extend_from_slice(&data[..take]);
            data = &data[take..];
            while self.pending.len() - self.tail >= chunk {
                self.jobs.push(Job {
                    tensor: idx,
                    wb,
                    bytes: self.tail..self.tail + chunk,
                });
                self.tail += chunk;
            }
            if self.pending.len() >= batch || self.jobs.len() >= Self::max_jobs() {
                self.flush()?;
            }
        }
        Ok(())
    }

    /// Ends the current tensor (all its bytes must have been written). Its
    /// last chunks may stay in the batch until more tensors fill it, or until
    /// [`Self::finish`].
    pub fn end_tensor(&mut self) -> Result<()> {
        let Some(o) = &self.open else {
            return Err(Error::Config(
                "planes writer: end_tensor without begin_tensor".into(),
            ));
        };
        if o.received != o.total {
            return Err(Error::tensor(
                &self.tensors[o.idx].name,
                format!(
                    "ended after {} bytes, dtype and shape hold {}",
                    o.received, o.total
                ),
            ));
        }
        if self.pending.len() > self.tail {
            self.jobs.push(Job {
                tensor: o.idx,
                wb: o.wb,
                bytes: self.tail..self.pending.len(),
            });
            self.tail = self.pending.len();
        }
        self.open = None;
        if self.jobs.len() >= Self::max_jobs() {
            self.flush()?;
        }
        Ok(())
    }

    /// Writes one whole tensor ([`Self::begin_tensor`], [`Self::write`],
    /// [`Self::end_tensor`]).
    pub fn tensor(&mut self, name: &str, dtype: Dtype, shape: &[usize], data: &[u8]) -> Result<()> {
        self.begin_tensor(name, dtype, shape)?;
        self.write(data)?;
        self.end_tensor()
    }

    /// Compresses the batch's chunks and keeps the open tensor's uncut bytes.
    fn flush(&mut self) -> Result<()> {
        let pending = std::mem::take(&mut self.pending);
        let jobs = std::mem::take(&mut self.jobs);
        let r = self.run(&pending, &jobs);
        self.pending = pending;
        self.pending.drain(..self.tail);
        self.tail = 0;
        self.jobs = jobs;
        self.jobs.clear();
        r
    }

    /// Compresses `jobs` (chunks in `src`) in parallel and appends them to the
    /// sink in order.
    fn run(&mut self, src: &[u8], jobs: &[Job]) -> Result<()> {
        while self.workers.len() < jobs.len() {
            self.workers.push(Encoder::new(self.opts.level)?);
        }
        self.workers[..jobs.len()]
            .par_iter_mut()
            .zip(jobs.par_iter())
            .for_each(|(e, j)| e.chunk(j.wb, &src[j.bytes.clone()]));
        for (e, j) in self.workers.iter().zip(jobs) {
            self.sink
                .write_all(&e.out[..e.used])
                .map_err(|err| Error::io("writing compressed anchor chunks", err))?;
            let t = &mut self.tensors[j.tensor];
            t.chunks.push(e.lens.clone());
            t.stored += e.used as u64;
            self.written += e.used as u64;
        }
        Ok(())
    }

    /// Ends the object: returns the prefix (which goes *before* the sink's
    /// bytes) and the sink. `digests` holds every written tensor's digest
    /// (docs/format.md §3) under its name.
    pub fn finish(
        mut self,
        model_version: u64,
        digests: &BTreeMap<String, Digest>,
    ) -> Result<Finished<W>> {
        if let Some(o) = &self.open {
            return Err(Error::tensor(
                &self.tensors[o.idx].name,
                "not ended before finish",
            ));
        }
        if digests.len() != self.tensors.len() {
            return Err(Error::Config(format!(
                "planes writer: {} digests for {} tensors",
                digests.len(),
                self.tensors.len()
            )));
        }
        self.flush()?;
        let mut items = Vec::with_capacity(self.tensors.len());
        for t in &self.tensors {
            let d = digests
                .get(&t.name)
                .ok_or_else(|| Error::tensor(&t.name, "no digest given"))?;
            let words =
                byte_len(t.dtype, &t.shape).expect("checked at begin") / word_bytes(t.dtype);
            items.push((
                t.name.as_str(),
                t.dtype,
                t.shape.as_slice(),
                words as u64,
                *d,
            ));
        }
        let header = super::anchor_header_of(items, model_version, Encoding::Planes);
        let table = PlanesTable {
            chunk_words: self.opts.chunk_words,
            tensors: self
                .tensors
                .iter()
                .map(|t| (t.name.clone(), t.chunks.clone()))
                .collect(),
        };
        let mut meta = header.to_metadata();
        super::keep_trainer_metadata(&mut meta, &self.metadata);
        meta.insert(
            keys::PLANES.to_string(),
            serde_json::to_string(&table).expect("serializable"),
        );
        let names: Vec<String> = self
            .tensors
            .iter()
            .map(|t| format!("{}{SUFFIX}", t.name))
            .collect();
        let shapes: Vec<[usize; 1]> = self.tensors.iter().map(|t| [t.stored as usize]).collect();
        let lens: Vec<(&str, Dtype, &[usize], usize)> = names
            .iter()
            .zip(&shapes)
            .map(|(n, s)| (n.as_str(), Dtype::U8, s.as_slice(), s[0]))
            .collect();
        let prefix = super::object_prefix(&lens, &meta)?;
        let raw_bytes = self
            .tensors
            .iter()
            .map(|t| byte_len(t.dtype, &t.shape).expect("checked") as u64)
            .sum();
        Ok(Finished {
            prefix,
            sink: self.sink,
            data_bytes: self.written,
            raw_bytes,
            header,
        })
    }
}

// ---------------------------------------------------------------------------
// Layout (what the header says) and decoding.

/// One chunk of a tensor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlanesChunk {
    /// Its stored bytes, as offsets in the object.
    pub stored: Range<u64>,
    /// Its decoded bytes, as offsets in the tensor's data.
    pub decoded: Range<u64>,
    /// Stored length of each plane (equal to the word count: raw).
    pub planes: Vec<u64>,
}

/// One tensor of a `planes` anchor.
#[derive(Clone, Debug)]
pub struct PlanesTensor {
    /// Name.
    pub name: String,
    /// dtype.
    pub dtype: Dtype,
    /// Shape.
    pub shape: Vec<usize>,
    /// Digest seed.
    pub seed: TensorSeed,
    /// Digest of the decoded tensor, from the header.
    pub digest: Digest,
    /// `<name>.planes` in the object.
    pub stored: Range<u64>,
    /// The tensor's bytes in the materialized anchor's data section.
    pub decoded: Range<u64>,
    /// Its chunks, in order.
    pub chunks: Vec<PlanesChunk>,
}

/// The validated header of a `planes` anchor: where every chunk is and where
/// it decodes to.
#[derive(Clone, Debug)]
pub struct PlanesLayout {
    /// The weightcast header (`encoding = planes`).
    pub header: Header,
    /// The safetensors `__metadata__`.
    pub metadata: BTreeMap<String, String>,
    /// Words per chunk.
    pub chunk_words: u64,
    /// Size of the whole object.
    pub object_len: u64,
    /// Tensors sorted by name: the order of the materialized anchor.
    pub tensors: Vec<PlanesTensor>,
}

/// How many bytes of an object [`PlanesLayout::parse`] needs (the 8-byte
/// length and the header), from at least its first 8 bytes.
pub fn prefix_len(first: &[u8]) -> Result<u64> {
    let n: [u8; 8] = first
        .get(..8)
        .and_then(|b| b.try_into().ok())
        .ok_or_else(|| Error::Container("fewer than 8 bytes".into()))?;
    let n = u64::from_le_bytes(n);
    if n > MAX_HEADER {
        return Err(Error::Container(format!(
            "header of {n} bytes, more than the {MAX_HEADER} accepted"
        )));
    }
    Ok(8 + n)
}

/// Whether a weightcast header describes a `planes` anchor.
pub fn is_planes(h: &Header) -> bool {
    h.kind == Kind::Anchor && h.encoding == Encoding::Planes
}

impl PlanesLayout {
    /// Parses and validates a `planes` anchor's header from the object's first
    /// bytes (at least [`prefix_len`] of them; more are ignored).
    pub fn parse(prefix: &[u8]) -> Result<Self> {
        let n = prefix_len(prefix)?;
        let head = prefix.get(8..n as usize).ok_or_else(|| {
            Error::Container(format!(
                "{} bytes given, the header needs {n}",
                prefix.len()
            ))
        })?;
        let st: safetensors::tensor::Metadata =
            serde_json::from_slice(head).map_err(|e| Error::Container(e.to_string()))?;
        let metadata: BTreeMap<String, String> = st
            .metadata()
            .clone()
            .unwrap_or_default()
            .into_iter()
            .collect();
        let header = Header::from_metadata(&metadata)?
            .ok_or_else(|| Error::metadata(keys::FORMAT, "missing: not a weightcast object"))?;
        if !is_planes(&header) {
            return Err(Error::metadata(
                keys::ENCODING,
                format!(
                    "a {:?} `{}` object, not a planes anchor",
                    header.kind, header.encoding
                ),
            ));
        }
        let table: PlanesTable = serde_json::from_str(
            metadata
                .get(keys::PLANES)
                .ok_or_else(|| Error::metadata(keys::PLANES, "missing (required for planes)"))?,
        )
        .map_err(|e| Error::metadata(keys::PLANES, e.to_string()))?;
        if !(1..=MAX_CHUNK_WORDS).contains(&table.chunk_words) {
            return Err(Error::metadata(
                format!("{}.chunk_words", keys::PLANES),
                format!("{} is not within 1..={MAX_CHUNK_WORDS}", table.chunk_words),
            ));
        }
        let count = header.tensors.len();
        if header.tensor_count != count as u64 {
            return Err(Error::metadata(
                keys::TENSOR_COUNT,
                format!("header says {} tensors, lists {count}", header.tensor_count),
            ));
        }
        let stored_tensors = st.tensors();
        if stored_tensors.len() != count || table.tensors.len() != count {
            return Err(Error::Container(format!(
                "{} stored tensors and {} chunk lists for {count} tensors",
                stored_tensors.len(),
                table.tensors.len()
            )));
        }
        let data_start = n;
        let mut decoded_at = 0u64;
        let mut tensors = Vec::with_capacity(count);
        for (name, e) in &header.tensors {
            let field = |f: &str| format!("tensors.{name}.{f}");
            let dtype = parse_dtype(&e.dtype).map_err(|_| {
                Error::metadata(field("dtype"), format!("unknown dtype `{}`", e.dtype))
            })?;
            let shape: Vec<usize> = e
                .shape
                .iter()
                .map(|&d| usize::try_from(d))
                .collect::<std::result::Result<_, _>>()
                .map_err(|_| Error::metadata(field("shape"), "dimension too large"))?;
            let bytes = byte_len(dtype, &shape).ok_or_else(|| {
                Error::metadata(field("shape"), "overflows or is not byte-aligned")
            })? as u64;
            if element_count(&shape) != Some(e.elements) {
                return Err(Error::metadata(
                    field("elements"),
                    format!(
                        "{} is not the product of the shape {:?}",
                        e.elements, e.shape
                    ),
                ));
            }
            let digest = entry_digest(name, "digest", &e.digest)?;
            let key = format!("{name}{SUFFIX}");
            let info = stored_tensors
                .get(&key)
                .ok_or_else(|| Error::tensor(name, format!("stored tensor `{key}` missing")))?;
            if info.dtype != Dtype::U8 || info.shape.len() != 1 {
                return Err(Error::tensor(
                    name,
                    format!("`{key}` must be a 1-D U8 tensor"),
                ));
            }
            let stored =
                data_start + info.data_offsets.0 as u64..data_start + info.data_offsets.1 as u64;
            let list = table.tensors.get(name).ok_or_else(|| {
                Error::metadata(format!("{}.tensors.{name}", keys::PLANES), "missing")
            })?;
            let wb = word_bytes(dtype) as u64;
            let words = bytes / wb;
            let want = words.div_ceil(table.chunk_words);
            if list.len() as u64 != want {
                return Err(Error::metadata(
                    format!("{}.tensors.{name}", keys::PLANES),
                    format!(
                        "{} chunks listed, {words} words in chunks of {} make {want}",
                        list.len(),
                        table.chunk_words
                    ),
                ));
            }
            let mut chunks = Vec::with_capacity(list.len());
            let mut at = stored.start;
            for (k, lens) in list.iter().enumerate() {
                let cfield = || format!("{}.tensors.{name}[{k}]", keys::PLANES);
                let first = k as u64 * table.chunk_words;
                let cw = table.chunk_words.min(words - first);
                if lens.len() as u64 != wb {
                    return Err(Error::metadata(
                        cfield(),
                        format!("{} planes listed, {} has {wb}", lens.len(), e.dtype),
                    ));
                }
                let mut len = 0u64;
                for (p, &l) in lens.iter().enumerate() {
                    if l == 0 || l > cw || (l < cw && cw > l.saturating_mul(MAX_FRAME_RATIO)) {
                        return Err(Error::metadata(
                            cfield(),
                            format!(
                                "plane {p} stored in {l} bytes, impossible for {cw} bytes \
                                 (raw: exactly {cw}; a zstd frame: 1..{cw}, at most \
                                 {MAX_FRAME_RATIO}x smaller)"
                            ),
                        ));
                    }
                    len += l;
                }
                let end = at + len;
                if end > stored.end {
                    return Err(Error::tensor(
                        name,
                        format!(
                            "chunk table runs past the {} stored bytes",
                            stored.end - stored.start
                        ),
                    ));
                }
                chunks.push(PlanesChunk {
                    stored: at..end,
                    decoded: first * wb..(first + cw) * wb,
                    planes: lens.clone(),
                });
                at = end;
            }
            if at != stored.end {
                return Err(Error::tensor(
                    name,
                    format!(
                        "the chunk table covers {} of the {} stored bytes",
                        at - stored.start,
                        stored.end - stored.start
                    ),
                ));
            }
            let decoded = decoded_at..decoded_at + bytes;
            decoded_at = decoded.end;
            tensors.push(PlanesTensor {
                name: name.clone(),
                seed: TensorSeed::new(name, dtype, &shape),
                dtype,
                shape,
                digest,
                stored,
                decoded,
                chunks,
            });
        }
        Ok(PlanesLayout {
            header,
            metadata,
            chunk_words: table.chunk_words,
            object_len: data_start + st.data_len() as u64,
            tensors,
        })
    }

    /// Bytes of the materialized anchor's data section (all decoded tensors).
    pub fn decoded_len(&self) -> u64 {
        self.tensors.last().map_or(0, |t| t.decoded.end)
    }

    /// Number of chunks over all tensors.
    pub fn chunk_count(&self) -> usize {
        self.tensors.iter().map(|t| t.chunks.len()).sum()
    }

    /// The materialized (`full`) anchor's first bytes: the 8-byte length and
    /// the header, exactly what `codec::anchor_prefix` gives for the decoded
    /// tensors. Its data section (tensors in this layout's order) follows.
    pub fn raw_prefix(&self) -> Result<Vec<u8>> {
        let items = self.tensors.iter().map(|t| {
            let words = (t.decoded.end - t.decoded.start) / word_bytes(t.dtype) as u64;
            (
                t.name.as_str(),
                t.dtype,
                t.shape.as_slice(),
                words,
                t.digest,
            )
        });
        let h = super::anchor_header_of(items, self.header.model_version, Encoding::Full);
        let mut meta = h.to_metadata();
        super::keep_trainer_metadata(&mut meta, &self.metadata);
        let lens: Vec<(&str, Dtype, &[usize], usize)> = self
            .tensors
            .iter()
            .map(|t| {
                let len = (t.decoded.end - t.decoded.start) as usize;
                (t.name.as_str(), t.dtype, t.shape.as_slice(), len)
            })
            .collect();
        super::object_prefix(&lens, &meta)
    }

    /// Ranges of object bytes, each at most `max_bytes` long unless a single
    /// chunk is longer, that together cover the data section and each hold
    /// whole chunks: the ranged reads a reader can decode independently.
    pub fn windows(&self, max_bytes: u64) -> Vec<Range<u64>> {
        let mut spans: Vec<Range<u64>> = self
            .tensors
            .iter()
            .flat_map(|t| t.chunks.iter().map(|c| c.stored.clone()))
            .collect();
        spans.sort_by_key(|r| r.start);
        let mut out: Vec<Range<u64>> = Vec::new();
        for s in spans {
            match out.last_mut() {
                Some(w) if w.end == s.start && s.end - w.start <= max_bytes => w.end = s.end,
                _ => out.push(s),
            }
        }
        out
    }

    /// Decodes chunk `c` of tensor `t` from `src` (exactly its stored bytes)
    /// into `dst` (exactly its decoded bytes) and returns its digest
    /// contribution (the tensor's digest is the sum over its chunks).
    pub fn decode_chunk(&self, t: usize, c: usize, src: &[u8], dst: &mut [u8]) -> Result<Digest> {
        self.decode_chunk_as(t, c, src, dst, true)
    }

    fn decode_chunk_as(
        &self,
        t: usize,
        c: usize,
        src: &[u8],
        dst: &mut [u8],
        digest: bool,
    ) -> Result<Digest> {
        let tensor = &self.tensors[t];
        let chunk = &tensor.chunks[c];
        let wb = word_bytes(tensor.dtype);
        if src.len() as u64 != chunk.stored.end - chunk.stored.start
            || dst.len() as u64 != chunk.decoded.end - chunk.decoded.start
        {
            return Err(Error::tensor(
                &tensor.name,
                format!(
                    "chunk {c}: {} stored and {} decoded bytes given, {:?} and {:?} expected",
                    src.len(),
                    dst.len(),
                    chunk.stored,
                    chunk.decoded
                ),
            ));
        }
        decode_chunk_local(&tensor.name, c, wb, &chunk.planes, src, dst)?;
        if !digest {
            return Ok(Digest::default());
        }
        Ok(words_digest(
            tensor.seed,
            tensor.dtype,
            dst,
            chunk.decoded.start / wb as u64,
        ))
    }

    /// Decodes tensor `t` from the whole object into `dst` (its decoded bytes),
    /// chunks in parallel, and checks its digest.
    pub fn decode_tensor(&self, t: usize, object: &[u8], dst: &mut [u8]) -> Result<()> {
        self.decode_tensor_as(t, object, dst, true)
    }

    fn decode_tensor_as(
        &self,
        t: usize,
        object: &[u8],
        dst: &mut [u8],
        verify: bool,
    ) -> Result<()> {
        let tensor = &self.tensors[t];
        self.check_object(object)?;
        if dst.len() as u64 != tensor.decoded.end - tensor.decoded.start {
            return Err(Error::tensor(
                &tensor.name,
                format!(
                    "{} bytes given for {} decoded bytes",
                    dst.len(),
                    tensor.decoded.end - tensor.decoded.start
                ),
            ));
        }
        let chunk = self.chunk_words as usize * word_bytes(tensor.dtype);
        let sum = dst
            .par_chunks_mut(chunk.max(1))
            .enumerate()
            .map(|(c, d)| {
                let r = &tensor.chunks[c].stored;
                self.decode_chunk_as(t, c, &object[r.start as usize..r.end as usize], d, verify)
            })
            .try_reduce(Digest::default, |a, b| Ok(a.wrapping_add(b)))?;
        if !verify {
            return Ok(());
        }
        self.check_tensor(t, sum)
    }

    fn check_object(&self, object: &[u8]) -> Result<()> {
        if object.len() as u64 != self.object_len {
            return Err(Error::Container(format!(
                "object has {} bytes, its header describes {}",
                object.len(),
                self.object_len
            )));
        }
        Ok(())
    }

    fn check_tensor(&self, t: usize, got: Digest) -> Result<()> {
        let tensor = &self.tensors[t];
        if got != tensor.digest {
            return Err(Error::Integrity {
                scope: format!("tensor {}", tensor.name),
                expected: tensor.digest.to_string(),
                actual: got.to_string(),
            });
        }
        Ok(())
    }

    fn check_file(&self) -> Result<()> {
        let sum = self
            .tensors
            .iter()
            .fold(Digest::default(), |a, t| a.wrapping_add(t.digest));
        if sum != self.header.digest {
            return Err(Error::Integrity {
                scope: "file".into(),
                expected: self.header.digest.to_string(),
                actual: sum.to_string(),
            });
        }
        Ok(())
    }

    /// Decodes the whole object into the materialized anchor's data section
    /// (`data`, [`Self::decoded_len`] bytes), tensors and chunks in parallel,
    /// and checks every digest.
    pub fn decode_all(&self, object: &[u8], data: &mut [u8]) -> Result<()> {
        self.decode_all_as(object, data, true)
    }

    /// [`Self::decode_all`] without the digests (benchmarks: the decode alone).
    pub(crate) fn decode_all_as(&self, object: &[u8], data: &mut [u8], verify: bool) -> Result<()> {
        self.check_object(object)?;
        if data.len() as u64 != self.decoded_len() {
            return Err(Error::Container(format!(
                "{} bytes given for {} decoded bytes",
                data.len(),
                self.decoded_len()
            )));
        }
        let mut parts = Vec::with_capacity(self.tensors.len());
        let mut rest = data;
        for t in &self.tensors {
            let (mine, tail) = rest.split_at_mut((t.decoded.end - t.decoded.start) as usize);
            parts.push(mine);
            rest = tail;
        }
        parts
            .into_par_iter()
            .enumerate()
            .try_for_each(|(t, d)| self.decode_tensor_as(t, object, d, verify))?;
        if !verify {
            return Ok(());
        }
        self.check_file()
    }
}

/// The raw anchor a `planes` object stands for (every digest checked), or
/// `None` when `object` is not a `planes` anchor.
pub fn decode_object_if_planes(object: &[u8]) -> Result<Option<Vec<u8>>> {
    let (_, header) = super::inspect(object)?;
    if !header.as_ref().is_some_and(is_planes) {
        return Ok(None);
    }
    let layout = PlanesLayout::parse(&object[..prefix_len(object)? as usize])?;
    let mut out = layout.raw_prefix()?;
    let at = out.len();
    out.resize(at + layout.decoded_len() as usize, 0);
    layout.decode_all(object, &mut out[at..])?;
    Ok(Some(out))
}

/// Decodes a `planes` anchor from windows of its bytes (ranged reads, any
/// order) into the materialized anchor's data section, and checks the digests
/// once every chunk is in.
pub struct PlanesDecoder<'a> {
    layout: &'a PlanesLayout,
    /// Per tensor: digest contributions so far and chunks decoded.
    sums: Vec<(Digest, Vec<bool>)>,
    /// Tensor indices by stored offset.
    by_stored: Vec<usize>,
}

impl<'a> PlanesDecoder<'a> {
    /// A decoder for `layout`'s object.
    pub fn new(layout: &'a PlanesLayout) -> Self {
        let mut by_stored: Vec<usize> = (0..layout.tensors.len()).collect();
        by_stored.sort_by_key(|&t| layout.tensors[t].stored.start);
        PlanesDecoder {
            layout,
            sums: layout
                .tensors
                .iter()
                .map(|t| (Digest::default(), vec![false; t.chunks.len()]))
                .collect(),
            by_stored,
        }
    }

    /// Decodes every chunk not decoded yet whose stored bytes lie wholly in
    /// `window` (the object's bytes from offset `start`) into `data` (the
    /// materialized data section, [`PlanesLayout::decoded_len`] bytes), in
    /// parallel. Returns how many chunks it decoded.
    pub fn feed(&mut self, start: u64, window: &[u8], data: &mut [u8]) -> Result<usize> {
        let layout = self.layout;
        if data.len() as u64 != layout.decoded_len() {
            return Err(Error::Container(format!(
                "{} bytes given for {} decoded bytes",
                data.len(),
                layout.decoded_len()
            )));
        }
        let end = start + window.len() as u64;
        // (absolute decoded start, tensor, chunk)
        let mut jobs: Vec<(u64, usize, usize)> = Vec::new();
        for &t in &self.by_stored {
            let tensor = &layout.tensors[t];
            if tensor.stored.end <= start || tensor.stored.start >= end {
                continue;
            }
            let from = tensor.chunks.partition_point(|c| c.stored.start < start);
            for (c, chunk) in tensor.chunks.iter().enumerate().skip(from) {
                if chunk.stored.end > end {
                    break;
                }
                if !self.sums[t].1[c] {
                    jobs.push((tensor.decoded.start + chunk.decoded.start, t, c));
                }
            }
        }
        jobs.sort_unstable();
        // Disjoint destination slices, in decoded order.
        let mut work: Vec<(usize, usize, &mut [u8])> = Vec::with_capacity(jobs.len());
        let (mut rest, mut consumed): (&mut [u8], u64) = (data, 0);
        for &(at, t, c) in &jobs {
            let r = &layout.tensors[t].chunks[c].decoded;
            let tail = std::mem::take(&mut rest);
            let (_, tail) = tail.split_at_mut((at - consumed) as usize);
            let (mine, tail) = tail.split_at_mut((r.end - r.start) as usize);
            work.push((t, c, mine));
            rest = tail;
            consumed = at + (r.end - r.start);
        }
        let results: Vec<(usize, usize, Digest)> = work
            .into_par_iter()
            .map(|(t, c, dst)| {
                let s = &layout.tensors[t].chunks[c].stored;
                let src = &window[(s.start - start) as usize..(s.end - start) as usize];
                layout.decode_chunk(t, c, src, dst).map(|d| (t, c, d))
            })
            .collect::<Result<_>>()?;
        let n = results.len();
        for (t, c, d) in results {
            let s = &mut self.sums[t];
            s.0 = s.0.wrapping_add(d);
            s.1[c] = true;
        }
        Ok(n)
    }

    /// Whether every chunk has been decoded.
    pub fn complete(&self) -> bool {
        self.sums.iter().all(|(_, done)| done.iter().all(|&d| d))
    }

    /// Checks that every chunk was decoded and that every tensor and the file
    /// have the header's digests; returns the tensors' digests in layout order.
    pub fn finish(self) -> Result<Vec<Digest>> {
        for (t, (sum, done)) in self.sums.iter().enumerate() {
            if let Some(c) = done.iter().position(|&d| !d) {
                return Err(Error::tensor(
                    &self.layout.tensors[t].name,
                    format!("chunk {c} was never decoded (no window held all of it)"),
                ));
            }
            self.layout.check_tensor(t, *sum)?;
        }
        self.layout.check_file()?;
        Ok(self.sums.into_iter().map(|(d, _)| d).collect())
    }
}

/// Writes the plain (`full`) anchor that the `planes` object `object` stands
/// for into `w`, decoding a bounded batch of chunks at a time and checking
/// every digest; returns the bytes written. On an error, what was written is
/// incomplete and must be discarded.
pub fn materialize(object: &[u8], w: &mut impl Write) -> Result<u64> {
    let layout = PlanesLayout::parse(object)?;
    layout.check_object(object)?;
    let io = |e| Error::io("writing the materialized anchor", e);
    let prefix = layout.raw_prefix()?;
    w.write_all(&prefix).map_err(io)?;
    let mut buf = Vec::new();
    let batch = (16usize << 20).max(rayon::current_num_threads());
    for (t, tensor) in layout.tensors.iter().enumerate() {
        let chunk = (layout.chunk_words as usize * word_bytes(tensor.dtype)).max(1);
        let per = (batch / chunk).max(rayon::current_num_threads()).max(1);
        let mut sum = Digest::default();
        for (g, group) in tensor.chunks.chunks(per).enumerate() {
            let len: u64 = group.iter().map(|c| c.decoded.end - c.decoded.start).sum();
            buf.resize(len as usize, 0);
            let first = g * per;
            let d = buf
                .par_chunks_mut(chunk)
                .zip(group.par_iter())
                .enumerate()
                .map(|(i, (dst, c))| {
                    let src = &object[c.stored.start as usize..c.stored.end as usize];
                    layout.decode_chunk(t, first + i, src, dst)
                })
                .try_reduce(Digest::default, |a, b| Ok(a.wrapping_add(b)))?;
            sum = sum.wrapping_add(d);
            w.write_all(&buf).map_err(io)?;
        }
        layout.check_tensor(t, sum)?;
    }
    layout.check_file()?;
    Ok(prefix.len() as u64 + layout.decoded_len())
}

/// Decodes a whole `planes` object into the materialized anchor's bytes
/// (prefix and data), every digest checked; returns them with the layout and
/// the tensors' digests.
pub(crate) fn decode_object(object: &[u8]) -> Result<(PlanesLayout, Vec<u8>)> {
    let layout = PlanesLayout::parse(object)?;
    layout.check_object(object)?;
    let prefix = layout.raw_prefix()?;
    let total = (prefix.len() as u64)
        .checked_add(layout.decoded_len())
        .and_then(|t| usize::try_from(t).ok())
        .ok_or_else(|| Error::Container("decoded anchor does not fit in memory".into()))?;
    let mut out = Vec::new();
    out.try_reserve_exact(total).map_err(|_| {
        Error::Container(format!(
            "cannot allocate {total} bytes for the decoded anchor"
        ))
    })?;
    out.extend_from_slice(&prefix);
    out.resize(total, 0);
    layout.decode_all(object, &mut out[prefix.len()..])?;
    Ok((layout, out))
}

#[cfg(test)]
mod tests {
    use super::*;

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

    // -----------------------------------------------------------------------
    // Round trips, determinism, streaming, malformed input.

    use crate::codec::{
        encode_anchor, encode_anchor_compressed, inspect, materialize_anchor, read_anchor,
        write_anchor_compressed, write_anchor_planes,
    };
    use crate::tensors::{TensorSet, safetensors_header_lens};

    fn noise(seed: u64, n: usize) -> Vec<u8> {
        let mut x = seed;
        (0..n)
            .map(|i| {
                x = crate::digest::fmix64(x.wrapping_add(i as u64));
                // Half the bytes low-entropy, so planes both compress and not.
                if i % 3 == 0 { (x & 3) as u8 } else { x as u8 }
            })
            .collect()
    }

    const SMALL: PlanesOptions = PlanesOptions {
        chunk_words: 64,
        level: LEVEL,
        batch_bytes: 256,
    };

    fn planes_bytes(set: &TensorSet, opts: PlanesOptions) -> Vec<u8> {
        let f = write_anchor_planes(set, 3, opts, Vec::new()).unwrap();
        let mut out = f.prefix;
        out.extend_from_slice(&f.sink);
        out
    }

    /// Every dtype, at sizes around the chunk size (and empty, and 0-d).
    fn every_dtype_set() -> TensorSet {
        let mut items = Vec::new();
        for (k, dtype) in [
            Dtype::BOOL,
            Dtype::F4,
            Dtype::F6_E2M3,
            Dtype::F6_E3M2,
            Dtype::U8,
            Dtype::I8,
            Dtype::F8_E5M2,
            Dtype::F8_E4M3,
            Dtype::F8_E8M0,
            Dtype::I16,
            Dtype::U16,
            Dtype::F16,
            Dtype::BF16,
            Dtype::I32,
            Dtype::U32,
            Dtype::F32,
            Dtype::C64,
            Dtype::F64,
            Dtype::I64,
            Dtype::U64,
        ]
        .into_iter()
        .enumerate()
        {
            // Packed dtypes need whole bytes: element counts multiple of 4.
            for (j, elements) in [0usize, 4, 60, 64, 68, 128, 200, 1000]
                .into_iter()
                .enumerate()
            {
                let shape = vec![elements];
                let len = byte_len(dtype, &shape).unwrap();
                items.push((
                    format!("{dtype}.{j}"),
                    dtype,
                    shape,
                    noise((k * 10 + j) as u64, len),
                ));
            }
            let scalar = byte_len(dtype, &[]).filter(|&l| l > 0);
            if let Some(len) = scalar {
                items.push((
                    format!("{dtype}.scalar"),
                    dtype,
                    vec![],
                    noise(k as u64, len),
                ));
            }
        }
        TensorSet::from_tensors(items).unwrap()
    }

    fn assert_same(a: &TensorSet, b: &TensorSet) {
        assert_eq!(a.len(), b.len());
        for (i, (x, y)) in a.tensors().iter().zip(b.tensors()).enumerate() {
            assert_eq!(
                (&x.name, x.dtype, &x.shape, x.digest),
                (&y.name, y.dtype, &y.shape, y.digest)
            );
            assert!(a.data(i) == b.data(i), "tensor {} differs", x.name);
        }
        assert_eq!(a.digest(), b.digest());
    }

    #[test]
    fn every_dtype_round_trips_and_materializes_to_the_raw_anchor() {
        let set = every_dtype_set();
        let (raw, _) = encode_anchor(&set, 3).unwrap();
        for opts in [SMALL, PlanesOptions::default()] {
            let obj = planes_bytes(&set, opts);
            let (h, back) = read_anchor(obj.clone()).unwrap();
            let h = h.unwrap();
            assert_eq!(h.encoding, Encoding::Planes);
            assert_eq!(h.digest, set.digest());
            assert_same(&set, &back);
            // Materialized: exactly the raw anchor's bytes.
            let mut m = Vec::new();
            let n = materialize_anchor(&obj, &mut m).unwrap();
            assert_eq!(n, m.len() as u64);
            assert!(m == raw, "materialized bytes differ from write_anchor's");
            let layout = PlanesLayout::parse(&obj).unwrap();
            assert_eq!(
                layout.raw_prefix().unwrap(),
                crate::codec::anchor_prefix(&set, 3).unwrap()
            );
            // inspect agrees with read_anchor, and planes anchors are not `format=pt`.
            let (meta, ih) = inspect(&obj).unwrap();
            assert_eq!(ih.as_ref(), Some(&h));
            assert!(!meta.contains_key("format"));
        }
        // A raw anchor materializes as itself.
        let mut m = Vec::new();
        materialize_anchor(&raw, &mut m).unwrap();
        assert_eq!(m, raw);
    }

    #[test]
    fn generator_weights_compress_and_round_trip() {
        let mut g = crate::generator::Generator::new(crate::generator::GeneratorConfig::tiny(5));
        g.step();
        let set = g.snapshot();
        let (obj, summary) = encode_anchor_compressed(&set, 9).unwrap();
        assert_eq!(summary.bytes, obj.len() as u64);
        let (raw, _) = encode_anchor(&set, 9).unwrap();
        let (h_raw, from_raw) = read_anchor(raw.clone()).unwrap();
        let (h, back) = read_anchor(obj.clone()).unwrap();
        assert_same(&from_raw, &back);
        assert_eq!(h.unwrap().digest, h_raw.unwrap().digest);
        // bf16 weights: the high plane compresses, so the object is smaller.
        assert!(
            (obj.len() as f64) < raw.len() as f64 / 1.2,
            "{} vs {}",
            obj.len(),
            raw.len()
        );
        // The streaming writer through a spill file gives the same bytes.
        let mut streamed = Vec::new();
        let s2 = write_anchor_compressed(&set, 9, &mut streamed).unwrap();
        assert_eq!(streamed, obj);
        assert_eq!(s2.bytes, obj.len() as u64);
    }

    #[test]
    fn parallel_sequential_and_piecewise_writes_give_the_same_bytes() {
        let set = every_dtype_set();
        let one = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .build()
            .unwrap();
        let four = rayon::ThreadPoolBuilder::new()
            .num_threads(4)
            .build()
            .unwrap();
        let a = one.install(|| planes_bytes(&set, SMALL));
        let b = four.install(|| planes_bytes(&set, SMALL));
        assert!(a == b, "thread count changed the bytes");
        // Pieces of odd sizes, through the same writer.
        let mut w = PlanesWriter::new(Vec::new(), SMALL).unwrap();
        for (i, t) in set.tensors().iter().enumerate() {
            w.begin_tensor(&t.name, t.dtype, &t.shape).unwrap();
            let mut data = set.data(i);
            let mut step = 1;
            while !data.is_empty() {
                let k = step.min(data.len());
                w.write(&data[..k]).unwrap();
                data = &data[k..];
                step = step * 3 + 1;
            }
            w.end_tensor().unwrap();
        }
        let digests = set
            .tensors()
            .iter()
            .map(|t| (t.name.clone(), t.digest))
            .collect();
        let f = w.finish(3, &digests).unwrap();
        let mut c = f.prefix;
        c.extend_from_slice(&f.sink);
        assert!(a == c, "piecewise writes changed the bytes");
    }

    #[test]
    fn windowed_decode_equals_whole_decode_in_any_order() {
        let set = every_dtype_set();
        let obj = planes_bytes(&set, SMALL);
        let layout = PlanesLayout::parse(&obj[..prefix_len(&obj).unwrap() as usize]).unwrap();
        let mut whole = vec![0u8; layout.decoded_len() as usize];
        layout.decode_all(&obj, &mut whole).unwrap();
        for max in [1u64, 100, 1000, 1 << 20] {
            let mut windows = layout.windows(max);
            // Windows cover the data section exactly.
            assert_eq!(windows.first().unwrap().start, prefix_len(&obj).unwrap());
            assert_eq!(windows.last().unwrap().end, obj.len() as u64);
            windows.reverse();
            let mut data = vec![0xAAu8; whole.len()];
            let mut dec = PlanesDecoder::new(&layout);
            let mut decoded = 0;
            for w in &windows {
                decoded += dec
                    .feed(w.start, &obj[w.start as usize..w.end as usize], &mut data)
                    .unwrap();
            }
            assert_eq!(decoded, layout.chunk_count());
            assert!(dec.complete());
            let digests = dec.finish().unwrap();
            assert_eq!(digests.len(), set.len());
            assert!(data == whole, "windows of {max} bytes decode differently");
        }
        // Windows that cut chunks decode only the whole ones; a second pass
        // over overlapping windows completes without decoding twice.
        let mut data = vec![0u8; whole.len()];
        let mut dec = PlanesDecoder::new(&layout);
        let start = prefix_len(&obj).unwrap() as usize;
        let mut n = 0;
        for (a, b) in [(start, start + 777), (start + 777, obj.len())] {
            n += dec.feed(a as u64, &obj[a..b], &mut data).unwrap();
        }
        assert!(n < layout.chunk_count());
        assert!(!dec.complete());
        n += dec.feed(start as u64, &obj[start..], &mut data).unwrap();
        assert_eq!(n, layout.chunk_count());
        dec.finish().unwrap();
        assert!(data == whole);
        // A decoder missing chunks says which.
        let mut dec = PlanesDecoder::new(&layout);
        dec.feed(start as u64, &obj[start..start + 500], &mut data)
            .unwrap();
        let e = dec.finish().unwrap_err().to_string();
        assert!(e.contains("never decoded"), "{e}");
    }

    #[test]
    fn many_small_tensors_keep_the_workers_bounded() {
        let items: Vec<_> = (0..3000)
            .map(|i| (format!("t{i:05}"), Dtype::U8, vec![3], noise(i, 3)))
            .collect();
        let set = TensorSet::from_tensors(items).unwrap();
        let mut w = PlanesWriter::new(Vec::new(), PlanesOptions::default()).unwrap();
        for (i, t) in set.tensors().iter().enumerate() {
            w.tensor(&t.name, t.dtype, &t.shape, set.data(i)).unwrap();
        }
        assert!(w.workers.len() <= PlanesWriter::<Vec<u8>>::max_jobs());
        let digests = set
            .tensors()
            .iter()
            .map(|t| (t.name.clone(), t.digest))
            .collect();
        let f = w.finish(1, &digests).unwrap();
        let mut obj = f.prefix;
        obj.extend_from_slice(&f.sink);
        let (_, back) = read_anchor(obj).unwrap();
        assert_same(&set, &back);
    }

    #[test]
    fn writer_misuse_is_refused() {
        let mut w = PlanesWriter::new(Vec::new(), SMALL).unwrap();
        assert!(w.write(&[1]).is_err());
        w.begin_tensor("a", Dtype::F32, &[2]).unwrap();
        assert!(w.write(&[0; 9]).is_err());
        w.write(&[0; 4]).unwrap();
        assert!(w.begin_tensor("b", Dtype::U8, &[1]).is_err());
        assert!(w.end_tensor().is_err(), "4 of 8 bytes");
        w.write(&[0; 4]).unwrap();
        w.end_tensor().unwrap();
        assert!(w.begin_tensor("a", Dtype::U8, &[1]).is_err(), "duplicate");
        assert!(w.finish(0, &BTreeMap::new()).is_err(), "digest missing");
        let bad = PlanesOptions {
            chunk_words: 0,
            ..SMALL
        };
        assert!(PlanesWriter::new(Vec::new(), bad).is_err());
    }

    // --- malformed objects -------------------------------------------------

    /// The metadata and the stored tensors (in data order) of an object.
    type Parts = (BTreeMap<String, String>, Vec<(String, Vec<u8>)>);

    fn parts(obj: &[u8]) -> Parts {
        let st = safetensors::SafeTensors::deserialize(obj).unwrap();
        let (_, m) = safetensors::SafeTensors::read_metadata(obj).unwrap();
        let meta = m
            .metadata()
            .clone()
            .unwrap_or_default()
            .into_iter()
            .collect();
        let tensors = m
            .offset_keys()
            .into_iter()
            .map(|k| {
                let d = st.tensor(&k).unwrap().data().to_vec();
                (k, d)
            })
            .collect();
        (meta, tensors)
    }

    fn build(meta: &BTreeMap<String, String>, tensors: &[(String, Vec<u8>)]) -> Vec<u8> {
        let shapes: Vec<[usize; 1]> = tensors.iter().map(|t| [t.1.len()]).collect();
        let lens: Vec<(&str, Dtype, &[usize], usize)> = tensors
            .iter()
            .zip(&shapes)
            .map(|(t, s)| (t.0.as_str(), Dtype::U8, s.as_slice(), t.1.len()))
            .collect();
        let head = safetensors_header_lens(&lens, meta).unwrap();
        let mut out = (head.len() as u64).to_le_bytes().to_vec();
        out.extend_from_slice(&head);
        for t in tensors {
            out.extend_from_slice(&t.1);
        }
        out
    }

    fn table_of(meta: &BTreeMap<String, String>) -> PlanesTable {
        serde_json::from_str(&meta[keys::PLANES]).unwrap()
    }

    fn with_table(obj: &[u8], edit: impl FnOnce(&mut PlanesTable)) -> Vec<u8> {
        let (mut meta, tensors) = parts(obj);
        let mut t = table_of(&meta);
        edit(&mut t);
        meta.insert(keys::PLANES.into(), serde_json::to_string(&t).unwrap());
        build(&meta, &tensors)
    }

    /// Both readers refuse `obj`, with an error containing `want`; no panic.
    fn refused(obj: &[u8], want: &str) {
        for (what, r) in [
            ("read_anchor", read_anchor(obj.to_vec()).map(|_| ())),
            ("materialize", materialize(obj, &mut Vec::new()).map(|_| ())),
        ] {
            let e = r.expect_err(what).to_string();
            assert!(e.contains(want), "{what}: `{e}` lacks `{want}`");
        }
    }

    fn bf16_object() -> Vec<u8> {
        // Two tensors; `w` has 3 chunks of 64 words + 1 word, high planes
        // compress, low planes do not.
        let w: Vec<u8> = noise(1, 2 * 193)
            .chunks(2)
            .flat_map(|c| [c[0], 0x3c | (c[1] & 1)])
            .collect();
        let set = TensorSet::from_tensors(vec![
            ("w".to_string(), Dtype::BF16, vec![193], w),
            ("b".to_string(), Dtype::F32, vec![3], noise(2, 12)),
        ])
        .unwrap();
        planes_bytes(&set, SMALL)
    }

    #[test]
    fn malformed_chunk_tables_are_refused() {
        let obj = bf16_object();
        read_anchor(obj.clone()).unwrap();
        let t = table_of(&parts(&obj).0);
        let w = &t.tensors["w"];
        assert!(
            w[0][0] == 64 && w[0][1] < 64,
            "fixture: raw low, framed high: {w:?}"
        );

        refused(&with_table(&obj, |t| t.chunk_words = 0), "chunk_words");
        refused(
            &with_table(&obj, |t| t.chunk_words = MAX_CHUNK_WORDS + 1),
            "chunk_words",
        );
        refused(&with_table(&obj, |t| t.chunk_words = 128), "chunks listed");
        refused(
            &with_table(&obj, |t| {
                t.tensors.get_mut("w").unwrap().pop();
            }),
            "chunks listed",
        );
        refused(
            &with_table(&obj, |t| t.tensors.get_mut("w").unwrap()[1].push(1)),
            "planes listed",
        );
        refused(
            &with_table(&obj, |t| t.tensors.get_mut("w").unwrap()[1][1] = 0),
            "impossible",
        );
        refused(
            &with_table(&obj, |t| t.tensors.get_mut("w").unwrap()[1][1] = 65),
            "impossible",
        );
        // Lengths that do not add up to the stored bytes.
        refused(
            &with_table(&obj, |t| {
                let c = &mut t.tensors.get_mut("w").unwrap()[1];
                c[1] -= 1;
            }),
            "covers",
        );
        refused(
            &with_table(&obj, |t| {
                let c = &mut t.tensors.get_mut("w").unwrap()[0];
                c[1] += 1;
            }),
            "runs past",
        );
        // Shifting one byte between two frames keeps the sum: the frames break.
        let shifted = with_table(&obj, |t| {
            let w = t.tensors.get_mut("w").unwrap();
            w[0][1] += 1;
            w[1][1] -= 1;
        });
        refused(&shifted, "zstd frame");
        refused(
            &with_table(&obj, |t| {
                t.tensors.remove("w");
            }),
            "chunk lists",
        );
        let (mut meta, tensors) = parts(&obj);
        meta.remove(keys::PLANES);
        refused(&build(&meta, &tensors), keys::PLANES);
        meta.insert(keys::PLANES.into(), "[1,2]".into());
        refused(&build(&meta, &tensors), keys::PLANES);
        // The stored tensor renamed, or not U8.
        let (meta, mut tensors) = parts(&obj);
        tensors[0].0.push('x');
        refused(&build(&meta, &tensors), "missing");
        // Truncated object.
        refused(&obj[..obj.len() - 1], "");
        assert!(PlanesLayout::parse(&obj[..20]).is_err());
        assert!(prefix_len(&u64::MAX.to_le_bytes()).is_err());
    }

    #[test]
    fn corrupt_frames_and_planes_are_refused() {
        let obj = bf16_object();
        let layout = PlanesLayout::parse(&obj).unwrap();
        let w = layout.tensors.iter().find(|t| t.name == "w").unwrap();
        let c0 = &w.chunks[0];
        // A byte of the raw low plane: decodes, but the digest differs.
        let mut bad = obj.clone();
        bad[c0.stored.start as usize + 5] ^= 1;
        refused(&bad, "integrity check failed for tensor w");
        // Every byte of the high plane's frame flipped in turn: always refused.
        let frame = c0.stored.start + c0.planes[0]..c0.stored.start + c0.planes[0] + c0.planes[1];
        for i in frame.clone() {
            let mut bad = obj.clone();
            bad[i as usize] ^= 0x40;
            assert!(
                read_anchor(bad.clone()).is_err(),
                "byte {i} flipped was accepted"
            );
            assert!(materialize(&bad, &mut Vec::new()).is_err());
        }
        // A valid frame of the wrong length, and two frames in one plane.
        let mut z = zstd::bulk::Compressor::new(1).unwrap();
        let short = z.compress(&[0x3c; 10]).unwrap();
        let long = z.compress(&[0x3c; 1000]).unwrap();
        for (frame_bytes, want) in [
            (short.clone(), "decodes to 10 bytes"),
            (long, "corrupt zstd frame"),
            ([short.clone(), short].concat(), "zstd frame"),
        ] {
            let (meta, mut tensors) = parts(&obj);
            let i = tensors.iter().position(|t| t.0 == "w.planes").unwrap();
            let old = &tensors[i].1;
            let n0 = c0.planes[0] as usize;
            let n1 = c0.planes[1] as usize;
            let mut data = old[..n0].to_vec();
            data.extend_from_slice(&frame_bytes);
            data.extend_from_slice(&old[n0 + n1..]);
            tensors[i].1 = data;
            let mut meta = meta;
            let mut t = table_of(&meta);
            t.tensors.get_mut("w").unwrap()[0][1] = frame_bytes.len() as u64;
            meta.insert(keys::PLANES.into(), serde_json::to_string(&t).unwrap());
            refused(&build(&meta, &tensors), want);
        }
        // A digest in the header that does not match the data.
        let (mut meta, tensors) = parts(&obj);
        let mut entries: serde_json::Value = serde_json::from_str(&meta[keys::TENSORS]).unwrap();
        entries["b"]["digest"] = "0000000000000001".into();
        meta.insert(keys::TENSORS.into(), entries.to_string());
        refused(
            &build(&meta, &tensors),
            "integrity check failed for tensor b",
        );
    }
}
