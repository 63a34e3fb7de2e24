//! What a `planes` anchor's header says: the chunk table, and where every
//! chunk is stored and decodes to ([`PlanesLayout`]).

use std::collections::BTreeMap;
use std::ops::Range;

use serde::{Deserialize, Serialize};

use crate::digest::{Digest, TensorSeed};
use crate::dtype::{Dtype, byte_len, element_count, parse_dtype, word_bytes};
use crate::error::{Error, Result};
use crate::format::{Encoding, Header, Kind, entry_digest, keys};

/// Suffix of the `U8` tensor holding a tensor's chunks.
pub const SUFFIX: &str = ".planes";
/// Largest `chunk_words` a reader accepts (bounds its per-chunk scratch to
/// 8 · 2^22 bytes per worker).
pub const MAX_CHUNK_WORDS: u64 = 1 << 22;
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
        let h = crate::codec::header::anchor_header_of(
            items,
            self.header.model_version,
            Encoding::Full,
        );
        let mut meta = h.to_metadata();
        crate::codec::header::keep_trainer_metadata(&mut meta, &self.metadata);
        let lens: Vec<(&str, Dtype, &[usize], usize)> = self
            .tensors
            .iter()
            .map(|t| {
                let len = (t.decoded.end - t.decoded.start) as usize;
                (t.name.as_str(), t.dtype, t.shape.as_slice(), len)
            })
            .collect();
        crate::codec::header::object_prefix(&lens, &meta)
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
}
