//! The on-bucket object format: safetensors files whose `__metadata__` makes each
//! one self-describing. `docs/format.md` is the normative description; this
//! module is its implementation (names of keys, their types, parsing with
//! validation).
//!
//! Every value in `__metadata__` is a string (a safetensors rule). Integers are
//! decimal, digests 16 hex digits, and `weightcast.tensors` is a JSON object
//! encoded as a string.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::digest::Digest;
use crate::error::{Error, Result};

/// Value of `weightcast.format`.
pub const FORMAT_NAME: &str = "weightcast";
/// Value of `weightcast.format_version` written by this crate; readers refuse other versions.
pub const FORMAT_VERSION: u32 = 1;

/// Metadata keys.
pub mod keys {
    /// `"weightcast"`.
    pub const FORMAT: &str = "weightcast.format";
    /// `"1"`.
    pub const FORMAT_VERSION: &str = "weightcast.format_version";
    /// `"anchor"` or `"delta"`.
    pub const KIND: &str = "weightcast.kind";
    /// `"full"` or `"planes"` (anchors), `"compact"` or `"trl"` (deltas).
    pub const ENCODING: &str = "weightcast.encoding";
    /// Decimal u64: the version this object produces.
    pub const MODEL_VERSION: &str = "weightcast.model_version";
    /// Decimal u64: the version a delta applies to (deltas only).
    pub const BASE_VERSION: &str = "weightcast.base_version";
    /// Digest of the whole file state a delta applies to (deltas only).
    pub const BASE_DIGEST: &str = "weightcast.base_digest";
    /// Digest of the whole file state this object produces.
    pub const DIGEST: &str = "weightcast.digest";
    /// Decimal: number of tensors in the file state (all of them, changed or not).
    pub const TENSOR_COUNT: &str = "weightcast.tensor_count";
    /// Decimal: elements over all tensors of the file state.
    pub const TOTAL_ELEMENTS: &str = "weightcast.total_elements";
    /// Decimal: changed words over all tensors (anchors: all words).
    pub const CHANGED_ELEMENTS: &str = "weightcast.changed_elements";
    /// Decimal fraction: changed / total words.
    pub const DENSITY: &str = "weightcast.density";
    /// 64 hex digits: BLAKE3 of the data section (deltas only).
    pub const PAYLOAD_BLAKE3: &str = "weightcast.payload_blake3";
    /// JSON object: tensor name → [`super::TensorEntry`].
    pub const TENSORS: &str = "weightcast.tensors";
    /// JSON object: the chunk table of a `planes` anchor (see `codec::planes`).
    pub const PLANES: &str = "weightcast.planes";
    /// Decimal u64 (`compact2` deltas made with context): the version whose
    /// changes are the context (the delta's base version).
    pub const CONTEXT_VERSION: &str = "weightcast.context_version";
    /// Digest (`compact2` deltas made with context): the file state the
    /// context's changes start from.
    pub const CONTEXT_BASE_DIGEST: &str = "weightcast.context_base_digest";
    /// 16 hex digits (`compact2` deltas made with context): the checksum of
    /// the context's members.
    pub const CONTEXT_CHECKSUM: &str = "weightcast.context_checksum";
    /// JSON object of strings: the `__metadata__` a `full` anchor of the
    /// version a delta produces would carry, less its `weightcast.*` keys
    /// (the checkpoint file's own keys, and `format=pt`), on every delta; a
    /// reader's output takes it in place of the base's (docs/format.md §6).
    /// Anchors carry these keys as plain metadata instead.
    pub const METADATA: &str = "weightcast.metadata";
}

/// Anchor (full weights) or delta (changed elements only).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    /// Full weights.
    Anchor,
    /// Changed elements relative to a base version.
    Delta,
}

/// How an object's tensors are encoded.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Encoding {
    /// Anchors: the tensors themselves.
    Full,
    /// Deltas: Rice-coded positions and ulp-step (or raw) values, see docs/format.md.
    Compact,
    /// Deltas: the Hugging Face TRL `sparse_weight_patch` layout (I32 indices, absolute values).
    Trl,
    /// Deltas: `compact` with positions and values coded against the
    /// changes of the previous delta (its context), see docs/format.md §6.3.
    Compact2,
    /// Anchors: each tensor's byte planes, zstd-compressed in independent
    /// chunks (see `codec::planes` and docs/format.md §5.1).
    Planes,
}

impl Encoding {
    /// The name used in metadata and on the command line.
    pub fn as_str(&self) -> &'static str {
        match self {
            Encoding::Full => "full",
            Encoding::Compact => "compact",
            Encoding::Trl => "trl",
            Encoding::Planes => "planes",
            Encoding::Compact2 => "compact2",
        }
    }
}

impl fmt::Display for Encoding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Encoding {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "full" => Ok(Encoding::Full),
            "compact" => Ok(Encoding::Compact),
            "trl" => Ok(Encoding::Trl),
            "planes" => Ok(Encoding::Planes),
            "compact2" => Ok(Encoding::Compact2),
            _ => Err(Error::metadata(
                keys::ENCODING,
                format!("unknown encoding `{s}` (expected full, planes, compact, compact2 or trl)"),
            )),
        }
    }
}

/// Which generation of TRL's `sparse_weight_patch` layout a `trl` delta uses
/// (docs/format.md §6.2 and §11). Both are read; this picks what is written.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TrlGeneration {
    /// TRL PR #5417 (the one the blog describes): `<name>.indices` (I32) and
    /// `<name>.values`, a `changed_params` JSON list in the header.
    V1,
    /// TRL PRs #5932/#5937: `<name>.idx` (coded as the header's `encoding`
    /// says) and `<name>.val`, no `changed_params`.
    #[default]
    V3,
}

impl TrlGeneration {
    /// The name used on the command line (`v1`, `v3`).
    pub fn as_str(&self) -> &'static str {
        match self {
            TrlGeneration::V1 => "v1",
            TrlGeneration::V3 => "v3",
        }
    }
}

impl fmt::Display for TrlGeneration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for TrlGeneration {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "v1" => Ok(TrlGeneration::V1),
            "v3" => Ok(TrlGeneration::V3),
            _ => Err(Error::Config(format!(
                "unknown TRL generation `{s}` (expected v1 or v3)"
            ))),
        }
    }
}

/// How a TRL v3 delta codes its `<name>.idx` tensors: the value of TRL's
/// `encoding` header key.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TrlIndexEncoding {
    /// I32 absolute flat positions.
    Raw,
    /// Gaps `idx[k] - idx[k-1] - 1` (with `idx[-1] = -1`) as U16, or U32 for a
    /// parameter whose largest gap exceeds 0xFFFF; decoded as `cumsum(gaps + 1) - 1`.
    #[default]
    GapDelta,
    /// nvCOMP "Cascaded" over I32 positions (a U8 byte stream): needs nvCOMP on
    /// a GPU, neither read nor written by weightcast.
    NvcompCascaded,
}

impl TrlIndexEncoding {
    /// The value of TRL's `encoding` key (`raw`, `gap_delta`, `nvcomp_cascaded`).
    pub fn as_str(&self) -> &'static str {
        match self {
            TrlIndexEncoding::Raw => "raw",
            TrlIndexEncoding::GapDelta => "gap_delta",
            TrlIndexEncoding::NvcompCascaded => "nvcomp_cascaded",
        }
    }
}

impl fmt::Display for TrlIndexEncoding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for TrlIndexEncoding {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "raw" => Ok(TrlIndexEncoding::Raw),
            "gap_delta" => Ok(TrlIndexEncoding::GapDelta),
            "nvcomp_cascaded" => Ok(TrlIndexEncoding::NvcompCascaded),
            _ => Err(Error::metadata(
                "encoding",
                format!(
                    "unknown TRL index encoding `{s}` (expected raw, gap_delta or nvcomp_cascaded)"
                ),
            )),
        }
    }
}

/// What a `trl` delta or a TRL anchor looks like when weightcast writes one.
/// The default is TRL's newest layout: v3 with `gap_delta` indices.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct TrlOptions {
    /// The layout generation.
    pub generation: TrlGeneration,
    /// v3's index coding (ignored for v1, whose indices are always I32).
    pub index: TrlIndexEncoding,
}

impl TrlOptions {
    /// TRL v1 (PR #5417): I32 `.indices`, `.values`, `changed_params`.
    pub const V1: TrlOptions = TrlOptions {
        generation: TrlGeneration::V1,
        index: TrlIndexEncoding::Raw,
    };
    /// TRL v3 with `gap_delta` indices (the default).
    pub const V3: TrlOptions = TrlOptions {
        generation: TrlGeneration::V3,
        index: TrlIndexEncoding::GapDelta,
    };
}

/// How a compact block codes its values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ValueCoding {
    /// Signed ordered-key step from the base word, Exp-Golomb coded (needs the base).
    Step,
    /// The new word itself, `8 × word_bytes` bits (base-independent).
    Raw,
}

/// One block of a compact tensor payload.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BlockEntry {
    /// Changed words in this block.
    pub changes: u64,
    /// Rice parameter of the position gaps (0..=40).
    pub pos_k: u8,
    /// Value coding.
    pub values: ValueCoding,
    /// Exp-Golomb order of step magnitudes (0..=32; ignored for raw).
    pub val_k: u8,
    /// Length in bytes of this block's bit stream.
    pub bytes: u64,
}

/// Per-tensor description in `weightcast.tensors`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TensorEntry {
    /// safetensors dtype name of the parameter.
    pub dtype: String,
    /// Shape of the parameter.
    pub shape: Vec<u64>,
    /// Elements of the parameter (product of the shape).
    pub elements: u64,
    /// Changed diff words (anchors: all words).
    pub changed: u64,
    /// `changed / words`.
    pub density: f64,
    /// Digest of the parameter this object produces.
    pub digest: String,
    /// Digest of the parameter a delta applies to (deltas only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base_digest: Option<String>,
    /// Words per block (compact only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block_words: Option<u64>,
    /// Blocks (compact only), in order.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub blocks: Option<Vec<BlockEntry>>,
}

/// The weightcast part of an object's header, typed.
#[derive(Clone, Debug, PartialEq)]
pub struct Header {
    /// Anchor or delta.
    pub kind: Kind,
    /// Encoding of the tensors.
    pub encoding: Encoding,
    /// Version produced by this object.
    pub model_version: u64,
    /// Version a delta applies to.
    pub base_version: Option<u64>,
    /// Digest of the file state a delta applies to.
    pub base_digest: Option<Digest>,
    /// Digest of the file state this object produces.
    pub digest: Digest,
    /// Number of tensors in the file state.
    pub tensor_count: u64,
    /// Elements over all tensors of the file state.
    pub total_elements: u64,
    /// Changed words over all tensors.
    pub changed_elements: u64,
    /// Changed / total words.
    pub density: f64,
    /// BLAKE3 of the data section, hex (deltas).
    pub payload_blake3: Option<String>,
    /// Per-tensor entries: every tensor for anchors, changed tensors for deltas.
    pub tensors: BTreeMap<String, TensorEntry>,
    /// `compact2` deltas made with context: which context.
    pub context: Option<ContextRef>,
}

/// The context a `compact2` delta was made against (docs/format.md §6.3):
/// the changes from the state with digest `base_digest` to the delta's base
/// (version `version`), whose members have the checksum `checksum`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ContextRef {
    /// The version whose changes these are (the delta's base version).
    pub version: u64,
    /// The file state those changes start from.
    pub base_digest: Digest,
    /// Checksum of the members.
    pub checksum: u64,
}

impl Header {
    /// Renders the header as `__metadata__` entries (`full` anchors also get
    /// `format=pt`: they load as checkpoints; `planes` anchors do not).
    pub fn to_metadata(&self) -> BTreeMap<String, String> {
        let mut m = BTreeMap::new();
        let mut put = |k: &str, v: String| {
            m.insert(k.to_string(), v);
        };
        put(keys::FORMAT, FORMAT_NAME.into());
        put(keys::FORMAT_VERSION, FORMAT_VERSION.to_string());
        put(
            keys::KIND,
            match self.kind {
                Kind::Anchor => "anchor",
                Kind::Delta => "delta",
            }
            .into(),
        );
        put(keys::ENCODING, self.encoding.to_string());
        put(keys::MODEL_VERSION, self.model_version.to_string());
        if let Some(b) = self.base_version {
            put(keys::BASE_VERSION, b.to_string());
        }
        if let Some(d) = self.base_digest {
            put(keys::BASE_DIGEST, d.to_string());
        }
        put(keys::DIGEST, self.digest.to_string());
        put(keys::TENSOR_COUNT, self.tensor_count.to_string());
        put(keys::TOTAL_ELEMENTS, self.total_elements.to_string());
        put(keys::CHANGED_ELEMENTS, self.changed_elements.to_string());
        put(keys::DENSITY, format!("{:.9}", self.density));
        if let Some(h) = &self.payload_blake3 {
            put(keys::PAYLOAD_BLAKE3, h.clone());
        }
        put(
            keys::TENSORS,
            serde_json::to_string(&self.tensors).expect("serializable"),
        );
        if let Some(c) = &self.context {
            put(keys::CONTEXT_VERSION, c.version.to_string());
            put(keys::CONTEXT_BASE_DIGEST, c.base_digest.to_string());
            put(keys::CONTEXT_CHECKSUM, Digest(c.checksum).to_string());
        }
        if self.kind == Kind::Anchor && self.encoding == Encoding::Full {
            m.insert("format".into(), "pt".into());
        }
        m
    }

    /// Parses the weightcast keys of `__metadata__`. `Ok(None)` when the object
    /// has no `weightcast.format` key (a plain checkpoint or a foreign TRL file).
    pub fn from_metadata(m: &BTreeMap<String, String>) -> Result<Option<Header>> {
        let Some(name) = m.get(keys::FORMAT) else {
            return Ok(None);
        };
        if name != FORMAT_NAME {
            return Err(Error::metadata(
                keys::FORMAT,
                format!("`{name}` is not `{FORMAT_NAME}`"),
            ));
        }
        let version: u32 = req_parse(m, keys::FORMAT_VERSION)?;
        if version != FORMAT_VERSION {
            return Err(Error::metadata(
                keys::FORMAT_VERSION,
                format!(
                    "format version {version} is not supported (this build reads {FORMAT_VERSION})"
                ),
            ));
        }
        let kind = match req(m, keys::KIND)? {
            "anchor" => Kind::Anchor,
            "delta" => Kind::Delta,
            other => {
                return Err(Error::metadata(
                    keys::KIND,
                    format!("`{other}` is not anchor or delta"),
                ));
            }
        };
        let encoding: Encoding = req(m, keys::ENCODING)?.parse()?;
        match (kind, encoding) {
            (Kind::Anchor, Encoding::Full | Encoding::Planes)
            | (Kind::Delta, Encoding::Compact | Encoding::Compact2 | Encoding::Trl) => {}
            _ => {
                return Err(Error::metadata(
                    keys::ENCODING,
                    format!("encoding {encoding} is not valid for a {kind:?}"),
                ));
            }
        }
        let digest_of = |k: &str| -> Result<Digest> {
            Digest::parse(req(m, k)?).ok_or_else(|| Error::metadata(k, "not 16 hex digits"))
        };
        let (base_version, base_digest) = if kind == Kind::Delta {
            (
                Some(req_parse(m, keys::BASE_VERSION)?),
                Some(digest_of(keys::BASE_DIGEST)?),
            )
        } else {
            (None, None)
        };
        let density: f64 = req_parse(m, keys::DENSITY)?;
        if !(0.0..=1.0).contains(&density) {
            return Err(Error::metadata(keys::DENSITY, "not within [0, 1]"));
        }
        let tensors: BTreeMap<String, TensorEntry> =
            serde_json::from_str(req(m, keys::TENSORS)?)
                .map_err(|e| Error::metadata(keys::TENSORS, e.to_string()))?;
        let payload_blake3 = match m.get(keys::PAYLOAD_BLAKE3) {
            Some(h) if h.len() == 64 && h.bytes().all(|b| b.is_ascii_hexdigit()) => {
                Some(h.to_ascii_lowercase())
            }
            Some(_) => return Err(Error::metadata(keys::PAYLOAD_BLAKE3, "not 64 hex digits")),
            None => None,
        };
        let context = match m.get(keys::CONTEXT_VERSION) {
            None => None,
            Some(_) if encoding != Encoding::Compact2 || kind != Kind::Delta => {
                return Err(Error::metadata(
                    keys::CONTEXT_VERSION,
                    "only compact2 deltas have a context",
                ));
            }
            Some(_) => Some(ContextRef {
                version: req_parse(m, keys::CONTEXT_VERSION)?,
                base_digest: digest_of(keys::CONTEXT_BASE_DIGEST)?,
                checksum: digest_of(keys::CONTEXT_CHECKSUM)?.0,
            }),
        };
        if let Some(c) = &context
            && Some(c.version) != base_version
        {
            return Err(Error::metadata(
                keys::CONTEXT_VERSION,
                format!(
                    "{} is not the delta's base version {}: a delta's context is the changes \
                     that produced its base",
                    c.version,
                    base_version.unwrap_or_default()
                ),
            ));
        }
        if context.is_none()
            && (m.contains_key(keys::CONTEXT_BASE_DIGEST) || m.contains_key(keys::CONTEXT_CHECKSUM))
        {
            return Err(Error::metadata(
                keys::CONTEXT_VERSION,
                "missing beside the other context keys",
            ));
        }
        Ok(Some(Header {
            context,
            kind,
            encoding,
            model_version: req_parse(m, keys::MODEL_VERSION)?,
            base_version,
            base_digest,
            digest: digest_of(keys::DIGEST)?,
            tensor_count: req_parse(m, keys::TENSOR_COUNT)?,
            total_elements: req_parse(m, keys::TOTAL_ELEMENTS)?,
            changed_elements: req_parse(m, keys::CHANGED_ELEMENTS)?,
            density,
            payload_blake3,
            tensors,
        }))
    }
}

fn req<'a>(m: &'a BTreeMap<String, String>, k: &str) -> Result<&'a str> {
    m.get(k)
        .map(String::as_str)
        .ok_or_else(|| Error::metadata(k, "missing"))
}

fn req_parse<T: FromStr>(m: &BTreeMap<String, String>, k: &str) -> Result<T>
where
    T::Err: fmt::Display,
{
    req(m, k)?
        .parse()
        .map_err(|e: T::Err| Error::metadata(k, format!("cannot parse: {e}")))
}

/// Parses a tensor entry's digest field.
pub(crate) fn entry_digest(tensor: &str, field: &str, value: &str) -> Result<Digest> {
    Digest::parse(value)
        .ok_or_else(|| Error::metadata(format!("tensors.{tensor}.{field}"), "not 16 hex digits"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Header {
        let mut tensors = BTreeMap::new();
        tensors.insert(
            "w".to_string(),
            TensorEntry {
                dtype: "BF16".into(),
                shape: vec![2, 3],
                elements: 6,
                changed: 1,
                density: 1.0 / 6.0,
                digest: Digest(7).to_string(),
                base_digest: Some(Digest(8).to_string()),
                block_words: Some(1 << 22),
                blocks: Some(vec![BlockEntry {
                    changes: 1,
                    pos_k: 2,
                    values: ValueCoding::Step,
                    val_k: 0,
                    bytes: 1,
                }]),
            },
        );
        Header {
            kind: Kind::Delta,
            encoding: Encoding::Compact,
            model_version: 3,
            base_version: Some(2),
            base_digest: Some(Digest(1)),
            digest: Digest(2),
            tensor_count: 1,
            total_elements: 6,
            changed_elements: 1,
            density: 1.0 / 6.0,
            payload_blake3: Some("ab".repeat(32)),
            tensors,
            context: None,
        }
    }

    #[test]
    fn metadata_round_trip() {
        let h = sample();
        let m = h.to_metadata();
        let back = Header::from_metadata(&m).unwrap().unwrap();
        assert_eq!(back.tensors, h.tensors);
        assert_eq!(back.base_digest, h.base_digest);
        assert_eq!(back.model_version, 3);
    }

    #[test]
    fn bad_fields_are_named() {
        let mut m = sample().to_metadata();
        m.insert(keys::MODEL_VERSION.into(), "-1".into());
        let e = Header::from_metadata(&m).unwrap_err().to_string();
        assert!(e.contains(keys::MODEL_VERSION), "{e}");

        let mut m = sample().to_metadata();
        m.insert(keys::FORMAT_VERSION.into(), "2".into());
        assert!(Header::from_metadata(&m).is_err());

        let mut m = sample().to_metadata();
        m.insert(keys::TENSORS.into(), "{\"w\": 3}".into());
        let e = Header::from_metadata(&m).unwrap_err().to_string();
        assert!(e.contains(keys::TENSORS), "{e}");

        let mut m = sample().to_metadata();
        m.remove(keys::BASE_DIGEST);
        assert!(Header::from_metadata(&m).is_err());

        assert!(Header::from_metadata(&BTreeMap::new()).unwrap().is_none());
    }
}
