//! Delta parsing: a delta object's container, header and payload checked
//! and turned into jobs, one per changed tensor (its payload, checked
//! against the header entry and the local tensor's dtype and shape), which
//! every apply strategy (`apply`) runs. Weightcast deltas (`compact`, `trl`)
//! and foreign TRL `sparse_weight_patch` files.

use std::collections::BTreeMap;

use safetensors::SafeTensors;

use super::compact::{self, Context, TensorContext};
use super::header::{entry_matches, metadata_map};
use super::trl;
use crate::digest::Digest;
use crate::dtype::Dtype;
use crate::error::{Error, Result};
use crate::format::{BlockEntry, Encoding, Header, Kind, entry_digest, keys};

/// The context of a tensor a `compact2` delta made without context (or
/// that the context's delta did not change): no member.
static NO_MEMBERS: TensorContext = TensorContext {
    block_words: 0,
    blocks: Vec::new(),
};
use crate::tensors::TensorSet;

pub(super) enum Payload<'a> {
    Compact {
        block_words: u64,
        blocks: Vec<BlockEntry>,
        streams: Vec<&'a [u8]>,
        /// `None` for `compact`; for `compact2`, the tensor's context.
        context: Option<&'a TensorContext>,
    },
    Trl {
        indices: trl::Indices<'a>,
        values: &'a [u8],
    },
}

/// What a weightcast delta's header says about one changed tensor.
#[derive(Clone, Copy, Debug)]
pub(super) struct Expect {
    /// Changed words.
    pub(super) changed: u64,
    /// Digest after.
    pub(super) digest: Digest,
    /// Digest before.
    pub(super) base: Digest,
}

pub(super) struct Job<'a> {
    pub(super) idx: usize,
    pub(super) name: String,
    pub(super) expect: Option<Expect>,
    pub(super) payload: Payload<'a>,
}

/// Checks a delta's data section against `weightcast.payload_blake3`.
pub(super) fn check_payload(h: &Header, data: &[u8]) -> Result<()> {
    let want = h
        .payload_blake3
        .as_deref()
        .ok_or_else(|| Error::metadata(keys::PAYLOAD_BLAKE3, "missing (required for deltas)"))?;
    let got = crate::digest::blake3_of(data).to_hex();
    if got.as_str() != want {
        return Err(Error::Integrity {
            scope: "payload".into(),
            expected: want.into(),
            actual: got.to_string(),
        });
    }
    Ok(())
}

/// The local tensor a delta's header entry names, as job building sees it.
pub(super) struct Local<'s> {
    /// Its index among the caller's tensors.
    pub(super) idx: usize,
    pub(super) dtype: Dtype,
    pub(super) shape: &'s [usize],
    /// Its words (see [`word_bytes`]).
    pub(super) words: usize,
    /// Its digest, where the caller knows it (a [`TensorSet`]'s): checked
    /// against the entry's `base_digest` before anything is decoded.
    pub(super) digest: Option<Digest>,
}

/// The jobs of a weightcast delta: for each header entry, the local tensor it
/// names (`local`), checked against the entry (dtype, shape, base digest when
/// known), and its payload, checked against the entry and the file.
pub(super) fn weightcast_jobs<'a, 's>(
    h: &Header,
    st: &SafeTensors<'a>,
    context: Option<&'a Context>,
    local: impl Fn(&str) -> Option<Local<'s>>,
) -> Result<Vec<Job<'a>>> {
    let context = check_context(h, context)?;
    let mut jobs = Vec::with_capacity(h.tensors.len());
    let mut expected_payloads = 0usize;
    for (name, e) in &h.tensors {
        let t = local(name)
            .ok_or_else(|| Error::tensor(name, "in the delta but not in the local state"))?;
        if !entry_matches(e, t.dtype, t.shape) {
            return Err(Error::tensor(
                name,
                format!(
                    "delta is for {} {:?}, local tensor is {} {:?}",
                    e.dtype, e.shape, t.dtype, t.shape
                ),
            ));
        }
        let base = entry_digest(name, "base_digest", e.base_digest.as_deref().unwrap_or(""))?;
        if let Some(d) = t.digest
            && base != d
        {
            return Err(Error::WrongBase {
                scope: format!("tensor {name}"),
                expected: base.to_string(),
                actual: d.to_string(),
            });
        }
        let digest = entry_digest(name, "digest", &e.digest)?;
        let payload = match h.encoding {
            Encoding::Compact | Encoding::Compact2 => {
                expected_payloads += 1;
                let key = format!("{name}{}", compact::SUFFIX);
                let view = st
                    .tensor(&key)
                    .map_err(|_| Error::tensor(name, format!("payload tensor `{key}` missing")))?;
                if view.dtype() != Dtype::U8 || view.shape().len() != 1 {
                    return Err(Error::tensor(
                        name,
                        "compact payload must be a 1-D U8 tensor",
                    ));
                }
                let blocks = e
                    .blocks
                    .clone()
                    .ok_or_else(|| Error::metadata(format!("tensors.{name}.blocks"), "missing"))?;
                let block_words = e.block_words.ok_or_else(|| {
                    Error::metadata(format!("tensors.{name}.block_words"), "missing")
                })?;
                let streams =
                    compact::split_blocks(name, t.words as u64, block_words, &blocks, view.data())?;
                let context = if h.encoding == Encoding::Compact2 {
                    if block_words > compact::context::MAX_BLOCK_WORDS {
                        return Err(Error::metadata(
                            format!("tensors.{name}.block_words"),
                            "compact2 blocks have at most 2^30 words",
                        ));
                    }
                    let tc = context
                        .and_then(|c| c.tensors.get(name.as_str()))
                        .unwrap_or(&NO_MEMBERS);
                    if !tc.is_empty() && tc.block_words != block_words {
                        return Err(Error::WrongContext {
                            expected: format!("tensor `{name}` in blocks of {block_words} words"),
                            actual: format!("blocks of {} words", tc.block_words),
                        });
                    }
                    if tc.blocks.len() > blocks.len() {
                        return Err(Error::WrongContext {
                            expected: format!("tensor `{name}` in {} blocks", blocks.len()),
                            actual: format!("{} blocks", tc.blocks.len()),
                        });
                    }
                    // Members ascend within a block (every context is built
                    // or read back so): the last one bounds them all, and it
                    // must lie inside the block (the last block is shorter).
                    let words = t.words as u64;
                    for (b, ms) in tc.blocks.iter().enumerate() {
                        let len = words
                            .saturating_sub(b as u64 * block_words)
                            .min(block_words);
                        if ms.last().is_some_and(|&m| u64::from(m >> 2) >= len) {
                            return Err(Error::WrongContext {
                                expected: format!(
                                    "members inside block {b} of tensor `{name}` ({len} words)"
                                ),
                                actual: "a member past its end".into(),
                            });
                        }
                    }
                    Some(tc)
                } else {
                    None
                };
                Payload::Compact {
                    block_words,
                    blocks,
                    streams,
                    context,
                }
            }
            _ => {
                expected_payloads += 2;
                trl_payload(name, t.dtype, st)?
            }
        };
        jobs.push(Job {
            idx: t.idx,
            name: name.clone(),
            expect: Some(Expect {
                changed: e.changed,
                digest,
                base,
            }),
            payload,
        });
    }
    if st.len() != expected_payloads {
        return Err(Error::Container(format!(
            "{} tensors in the delta, the header describes {expected_payloads}",
            st.len()
        )));
    }
    Ok(jobs)
}

/// The context a `compact2` delta needs, checked against the one given:
/// `Some` when the delta was made with context (the given one then leads to
/// the delta's base and has the recorded version, start and checksum), `None`
/// when it was made without (whatever was given is not used).
fn check_context<'c>(h: &Header, given: Option<&'c Context>) -> Result<Option<&'c Context>> {
    let Some(want) = h.context else {
        return Ok(None);
    };
    let base = h.base_digest.expect("deltas have a base digest");
    let expected = format!(
        "the changes of version {} (from {} to {base}, checksum {})",
        want.version,
        want.base_digest,
        Digest(want.checksum)
    );
    match given {
        Some(c)
            if c.id.version == want.version
                && c.id.from == want.base_digest
                && c.id.to == base
                && c.id.checksum == want.checksum =>
        {
            Ok(Some(c))
        }
        Some(c) => Err(Error::WrongContext {
            expected,
            actual: format!(
                "the changes of version {} (from {} to {}, checksum {})",
                c.id.version,
                c.id.from,
                c.id.to,
                Digest(c.id.checksum)
            ),
        }),
        None => Err(Error::WrongContext {
            expected,
            actual: "none".into(),
        }),
    }
}

fn trl_payload<'a>(name: &str, dtype: Dtype, st: &SafeTensors<'a>) -> Result<Payload<'a>> {
    let (indices, values) = trl::payload(name, dtype, st, None)?;
    Ok(Payload::Trl { indices, values })
}

/// The jobs of a TRL file without weightcast keys (v1 or v3, see
/// [`trl::foreign_delta`]), after every structural check it allows: each
/// parameter exists locally, its pair is well-formed ([`trl::payload`]), the
/// file holds exactly those pairs, and the header's counts agree
/// ([`trl::check_counts`]). Order and bounds are checked by the apply. Empty
/// pairs (TRL v3 writes them for unchanged parameters) are checked, then dropped.
pub(super) fn foreign_trl_jobs<'a>(
    state: &TensorSet,
    map: &BTreeMap<String, String>,
    st: &SafeTensors<'a>,
) -> Result<Vec<Job<'a>>> {
    let file = trl::foreign_delta(map, st)?;
    let mut jobs = Vec::with_capacity(file.params.len());
    let (mut changed, mut numel) = (0u64, 0u64);
    for name in &file.params {
        let idx = state
            .position(name)
            .ok_or_else(|| Error::tensor(name, "in the delta but not in the local state"))?;
        let t = &state.tensors()[idx];
        let (indices, values) = trl::payload(name, t.dtype, st, file.index)?;
        changed += indices.len() as u64;
        numel += t.elements();
        if !indices.is_empty() || !values.is_empty() {
            jobs.push(Job {
                idx,
                name: name.clone(),
                expect: None,
                payload: Payload::Trl { indices, values },
            });
        }
    }
    let n = file.params.len();
    if st.len() != 2 * n {
        return Err(Error::Container(format!(
            "{} tensors in the file, {} expected for {n} changed parameters",
            st.len(),
            2 * n,
        )));
    }
    trl::check_counts(map, n, changed, numel, state.total_elements())?;
    Ok(jobs)
}

/// Opens a weightcast delta: the container, the header (a `delta`, whose
/// digests add up) and the payload's BLAKE3. Foreign TRL files, which carry
/// no digests, are refused.
pub(super) fn open(bytes: &[u8]) -> Result<(Header, SafeTensors<'_>)> {
    let (n, map) = metadata_map(bytes)?;
    let st = SafeTensors::deserialize(bytes).map_err(|e| Error::Container(e.to_string()))?;
    let header = match Header::from_metadata(&map)? {
        Some(h) if h.kind == Kind::Delta => h,
        Some(h) => {
            return Err(Error::metadata(
                keys::KIND,
                format!("object is an {:?}, not a delta", h.kind),
            ));
        }
        None => {
            return Err(Error::metadata(
                keys::FORMAT,
                "not a weightcast delta: verifying in place needs the digests only weightcast \
                 deltas carry (apply other TRL files to a TensorSet with apply_delta)",
            ));
        }
    };
    check_payload(&header, &bytes[8 + n..])?;
    check_sums(&header)?;
    Ok((header, st))
}

/// The header against itself: its tensors' digest changes must add up to the
/// file's (unchanged tensors contribute nothing). Without a local file
/// digest to compare with, this is what keeps `weightcast.digest` and
/// `weightcast.base_digest` honest.
fn check_sums(h: &Header) -> Result<()> {
    let mut sum = Digest(0);
    for (name, e) in &h.tensors {
        let base = entry_digest(name, "base_digest", e.base_digest.as_deref().unwrap_or(""))?;
        sum = sum.wrapping_add(entry_digest(name, "digest", &e.digest)?.wrapping_sub(base));
    }
    let base = h.base_digest.expect("deltas have a base digest");
    let file = h.digest.wrapping_sub(base);
    if sum != file {
        return Err(Error::metadata(
            keys::DIGEST,
            format!(
                "the tensors' digest changes add up to {sum}, but {} − {} is {file}",
                keys::DIGEST,
                keys::BASE_DIGEST
            ),
        ));
    }
    Ok(())
}
