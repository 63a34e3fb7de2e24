//! Writing a `planes` anchor: the streaming [`PlanesWriter`].

use std::collections::BTreeMap;
use std::io::Write;
use std::ops::Range;

use rayon::prelude::*;

use crate::digest::Digest;
use crate::dtype::{Dtype, byte_len, word_bytes};
use crate::error::{Error, Result};
use crate::format::{Encoding, Header, keys};

use super::kernels::Encoder;
use super::layout::{MAX_CHUNK_WORDS, PlanesTable, SUFFIX};

/// Words per chunk this writer uses by default (2^20: 2 MiB of bf16).
pub const CHUNK_WORDS: u64 = 1 << 20;
/// zstd level this writer uses by default.
pub const LEVEL: i32 = 1;

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
    pub(super) fn max_jobs() -> usize {
        4 * rayon::current_num_threads().max(16)
    }

    /// Workers (zstd contexts) the writer holds (tests: bounded by
    /// [`Self::max_jobs`]).
    #[cfg(test)]
    pub(super) fn worker_count(&self) -> usize {
        self.workers.len()
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
        let (header, mut prefix) = object_prefix(
            &self.tensors,
            self.opts.chunk_words,
            model_version,
            digests,
            &self.metadata,
        )?;
        // Padded to the bound a streaming uploader reserved before the
        // chunks existed ([`reserved_prefix_len`]): the same for every writer of
        // these tensors, whatever they compress to.
        let raw = raw_chunks(&self.tensors, self.opts.chunk_words);
        let (_, bound) = object_prefix(
            &raw,
            self.opts.chunk_words,
            model_version,
            digests,
            &self.metadata,
        )?;
        pad_prefix(&mut prefix, bound.len())?;
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

/// The object prefix (8-byte length, header) of `tensors`' chunks.
fn object_prefix(
    tensors: &[Written],
    chunk_words: u64,
    model_version: u64,
    digests: &BTreeMap<String, Digest>,
    trainer_metadata: &BTreeMap<String, String>,
) -> Result<(Header, Vec<u8>)> {
    let mut items = Vec::with_capacity(tensors.len());
    for t in tensors {
        let d = digests
            .get(&t.name)
            .ok_or_else(|| Error::tensor(&t.name, "no digest given"))?;
        let words = byte_len(t.dtype, &t.shape).expect("checked at begin") / word_bytes(t.dtype);
        items.push((
            t.name.as_str(),
            t.dtype,
            t.shape.as_slice(),
            words as u64,
            *d,
        ));
    }
    let header = crate::codec::header::anchor_header_of(items, model_version, Encoding::Planes);
    let table = PlanesTable {
        chunk_words,
        tensors: tensors
            .iter()
            .map(|t| (t.name.clone(), t.chunks.clone()))
            .collect(),
    };
    let mut meta = header.to_metadata();
    crate::codec::header::keep_trainer_metadata(&mut meta, trainer_metadata);
    meta.insert(
        keys::PLANES.to_string(),
        serde_json::to_string(&table).expect("serializable"),
    );
    let names: Vec<String> = tensors
        .iter()
        .map(|t| format!("{}{SUFFIX}", t.name))
        .collect();
    let shapes: Vec<[usize; 1]> = tensors.iter().map(|t| [t.stored as usize]).collect();
    let lens: Vec<(&str, Dtype, &[usize], usize)> = names
        .iter()
        .zip(&shapes)
        .map(|(n, s)| (n.as_str(), Dtype::U8, s.as_slice(), s[0]))
        .collect();
    let prefix = crate::codec::header::object_prefix(&lens, &meta)?;
    Ok((header, prefix))
}

/// `tensors` with every plane of every chunk stored raw: the largest table
/// (and stored lengths, and offsets) their chunks can have, since a stored
/// plane is never longer than its word count (docs/format.md §5.1).
fn raw_chunks(tensors: &[Written], chunk_words: u64) -> Vec<Written> {
    tensors
        .iter()
        .map(|t| {
            let wb = word_bytes(t.dtype);
            let words = (byte_len(t.dtype, &t.shape).expect("checked") / wb) as u64;
            let chunks: Vec<Vec<u64>> = (0..words.div_ceil(chunk_words))
                .map(|k| vec![chunk_words.min(words - k * chunk_words); wb])
                .collect();
            Written {
                name: t.name.clone(),
                dtype: t.dtype,
                shape: t.shape.clone(),
                chunks,
                stored: words * wb as u64,
            }
        })
        .collect()
}

/// Right-pads `prefix`'s header with spaces to `len` bytes of prefix.
fn pad_prefix(prefix: &mut Vec<u8>, len: usize) -> Result<()> {
    if prefix.len() > len {
        // Cannot happen: every number of the real header is at most the
        // bound's (format.md §5.1).
        return Err(Error::Container(format!(
            "planes header of {} bytes exceeds its bound of {len}",
            prefix.len()
        )));
    }
    prefix.resize(len, b' ');
    let n = (len - 8) as u64;
    prefix[..8].copy_from_slice(&n.to_le_bytes());
    Ok(())
}

/// Length of the prefix (the 8-byte header length and the header) of the
/// `planes` object [`PlanesWriter::finish`] makes of these tensors (name,
/// dtype, shape, digest, in the order they will be written), whatever their
/// chunks compress to: the header is padded to the length it would have with
/// every plane stored raw. An uploader can therefore place the data section
/// before the chunks exist (the object's first part is sent last).
pub fn reserved_prefix_len(
    tensors: &[(&str, Dtype, &[usize], Digest)],
    opts: &PlanesOptions,
    model_version: u64,
    trainer_metadata: &BTreeMap<String, String>,
) -> Result<usize> {
    let mut written = Vec::with_capacity(tensors.len());
    let mut digests = BTreeMap::new();
    for &(name, dtype, shape, digest) in tensors {
        byte_len(dtype, shape)
            .ok_or_else(|| Error::tensor(name, "shape overflows or is not byte-aligned"))?;
        if digests.insert(name.to_string(), digest).is_some() {
            return Err(Error::tensor(name, "duplicate tensor name"));
        }
        written.push(Written {
            name: name.to_string(),
            dtype,
            shape: shape.to_vec(),
            chunks: Vec::new(),
            stored: 0,
        });
    }
    let raw = raw_chunks(&written, opts.chunk_words);
    let (_, prefix) = object_prefix(
        &raw,
        opts.chunk_words,
        model_version,
        &digests,
        trainer_metadata,
    )?;
    Ok(prefix.len())
}
