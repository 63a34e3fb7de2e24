//! Hugging Face TRL's bucket layout ("delta weight sync"), both ways: a
//! follower for buckets TRL writes, and the pieces `publish --layout trl` uses
//! to write buckets a TRL receiver consumes unchanged. docs/format.md §11 is
//! the description; this module implements it.
//!
//! ```text
//! <prefix>/anchors/step_{step:06}.safetensors   full weights (step 1 and every multiple of N)
//! <prefix>/deltas/step_{step:06}.safetensors    changed elements of that step
//! ```
//!
//! No manifest, no `latest.json`, no checksum: the keys are the whole protocol.
//! A step is TRL's sync counter, from 1 (weightcast's versions count from 0:
//! step = version + 1). Following a bucket means loading the newest anchor and
//! replaying, in step order, the deltas after it: the subscriber's loop does,
//! over any sink (`subscriber::trl` plans it from these keys); this module
//! reads and checks the objects.
//!
//! What can be checked without checksums is checked (tensor names, dtypes,
//! shapes, index order and bounds, the header's counts, the step in the key
//! against the header's `model_version`); objects weightcast wrote also carry
//! weightcast's digests, which are verified. What TRL's format cannot tell is
//! whether a missing step had changes: TRL v3 writes no file for a step without
//! changes, so a gap in the steps is accepted.

use std::collections::BTreeMap;

use bytes::Bytes;
use serde::Serialize;

use crate::codec::trl::{self, version_of_step};
use crate::codec::{AnchorSummary, DeltaOptions, DeltaSummary, inspect, read_anchor};
use crate::error::{Error, Result};
use crate::format::{Encoding, Header, Kind, TrlGeneration, TrlOptions};
use crate::store::Store;
use crate::tensors::TensorSet;

pub use crate::codec::trl::step_of_version;

/// Folder of the anchors.
pub const ANCHORS: &str = "anchors";
/// Folder of the deltas.
pub const DELTAS: &str = "deltas";

/// The largest anchor a follower downloads by default (1 TiB): a listed size
/// above it is refused before any byte is read.
pub const MAX_ANCHOR_BYTES: u64 = 1 << 40;

/// Key of the anchor of `step`: `anchors/step_{step:06}.safetensors`.
pub fn anchor_key(step: u64) -> String {
    format!("{ANCHORS}/step_{step:06}.safetensors")
}

/// Key of the delta of `step`: `deltas/step_{step:06}.safetensors`.
pub fn delta_key(step: u64) -> String {
    format!("{DELTAS}/step_{step:06}.safetensors")
}

/// Parses a TRL object key: `anchors/` or `deltas/`, then `step_`, a step of at
/// least 6 digits zero-padded to 6 as TRL writes it, `.safetensors`. Anything
/// else (other files, other padding, subfolders) is not a TRL object.
pub fn parse_key(key: &str) -> Option<(Kind, u64)> {
    let (dir, file) = key.split_once('/')?;
    let kind = match dir {
        ANCHORS => Kind::Anchor,
        DELTAS => Kind::Delta,
        _ => return None,
    };
    let digits = file.strip_prefix("step_")?.strip_suffix(".safetensors")?;
    if digits.len() < 6 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let step: u64 = digits.parse().ok()?;
    (format!("{step:06}") == digits).then_some((kind, step))
}

/// TRL's anchor rule: step 1 and every multiple of `every` are anchors
/// (`step == 1 || step % every == 0`; `every` 0 means only step 1).
pub fn is_anchor_step(step: u64, every: u64) -> bool {
    step == 1 || (every > 0 && step.is_multiple_of(every))
}

/// The objects of a TRL bucket: step → size in bytes.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct TrlListing {
    /// Anchors by step.
    pub anchors: BTreeMap<u64, u64>,
    /// Deltas by step.
    pub deltas: BTreeMap<u64, u64>,
}

/// Lists the anchors and deltas of a TRL bucket (other keys are ignored).
pub async fn listing(store: &Store) -> Result<TrlListing> {
    Ok(TrlListing {
        anchors: steps(store, Kind::Anchor, None).await?,
        deltas: steps(store, Kind::Delta, None).await?,
    })
}

/// The steps (with sizes) of one folder, all of them or those after `after`
/// ([`Kind::Anchor`]: `anchors/`, [`Kind::Delta`]: `deltas/`).
/// After a step, the listing starts after its key (S3's `start-after`): key
/// order is step order while steps have 6 digits, so from step 100 000 on it
/// starts after `step_1` instead (every key with a leading 0 is skipped).
pub async fn steps(store: &Store, kind: Kind, after: Option<u64>) -> Result<BTreeMap<u64, u64>> {
    let dir = if kind == Kind::Anchor {
        ANCHORS
    } else {
        DELTAS
    };
    let listed = match after {
        Some(s) if s < 100_000 => store.list_after(dir, &format!("{dir}/step_{s:06}")).await?,
        Some(_) => store.list_after(dir, &format!("{dir}/step_1")).await?,
        None => store.list(dir).await?,
    };
    Ok(listed
        .into_iter()
        .filter_map(|l| match parse_key(&l.key) {
            Some((k, step)) if k == kind && after.is_none_or(|a| step > a) => Some((step, l.size)),
            _ => None,
        })
        .collect())
}

/// Whether the store holds a TRL bucket: at least one `anchors/step_*` object
/// and no weightcast commit manifest (`versions/`).
pub async fn is_trl_bucket(store: &Store) -> Result<bool> {
    if steps(store, Kind::Anchor, None).await?.is_empty() {
        return Ok(false);
    }
    Ok(store
        .list(crate::protocol::VERSIONS_PREFIX)
        .await?
        .is_empty())
}

/// Reads an object of at most `max` bytes that the listing showed as `listed`.
async fn read_bounded(store: &Store, key: &str, listed: u64, max: u64) -> Result<Bytes> {
    if listed > max {
        return Err(Error::TooLarge {
            key: key.to_string(),
            size: listed,
            max,
        });
    }
    store.get_at_most(key, max).await?.ok_or_else(|| {
        Error::metadata(
            "bucket",
            format!("`{key}` was listed but is gone (the bucket is being rewritten?)"),
        )
    })
}

/// Downloads and checks the anchor of `step` (listed at `listed` bytes, at
/// most `max`): a safetensors file whose TRL header agrees with its tensors
/// ([`trl::check_anchor`]) and with the step in its key, and whose
/// weightcast digests verify when it has them. Returns the tensors (digests
/// computed), whether weightcast digests were verified, and the object's
/// size and BLAKE3. Errors name the object.
pub async fn read_anchor_object(
    store: &Store,
    step: u64,
    listed: u64,
    max: u64,
) -> Result<(TensorSet, bool, u64, blake3::Hash)> {
    let key = anchor_key(step);
    let read = async {
        let body = read_bounded(store, &key, listed, max).await?;
        let (size, hash) = (body.len() as u64, blake3::hash(&body));
        let (header, set) = read_anchor(Vec::from(body))?;
        let model_version = trl::check_anchor(set.metadata(), &set)?;
        check_steps(model_version, header.as_ref(), Kind::Anchor, step)?;
        Ok((set, header.is_some(), size, hash))
    };
    read.await.map_err(|e| in_object(&key, e))
}

/// Downloads and checks the delta of `step` (listed at `listed` bytes, at
/// most `max`): TRL's keys (`format`, `sparse`, `model_version` = the key's
/// step), weightcast's keys when present (a `trl` delta to `step - 1`).
/// Everything the apply checks (indices, the digests against the base) is
/// checked when it is applied. Returns the object and whether it carries
/// weightcast digests. Errors name the object.
pub async fn read_delta_object(
    store: &Store,
    step: u64,
    listed: u64,
    max: u64,
) -> Result<(Bytes, bool)> {
    let key = delta_key(step);
    let read = async {
        let body = read_bounded(store, &key, listed, max).await?;
        let (map, header) = inspect(&body)?;
        if map.get(trl::keys::FORMAT).map(String::as_str) != Some(trl::FORMAT_NAME)
            || map.get(trl::keys::SPARSE).map(String::as_str) != Some("True")
        {
            return Err(Error::metadata(
                trl::keys::FORMAT,
                format!(
                    "a TRL delta has format=\"{}\" and sparse=\"True\"",
                    trl::FORMAT_NAME
                ),
            ));
        }
        if let Some(h) = &header
            && h.encoding != Encoding::Trl
        {
            return Err(Error::metadata(
                crate::format::keys::ENCODING,
                format!(
                    "a {} delta in a TRL bucket (TRL reads only trl deltas)",
                    h.encoding
                ),
            ));
        }
        check_steps(
            trl::model_version_key(&map)?,
            header.as_ref(),
            Kind::Delta,
            step,
        )?;
        Ok((body, header.is_some()))
    };
    read.await.map_err(|e| in_object(&key, e))
}

/// The step in an object's key must agree with TRL's `model_version` key and
/// with weightcast's header (version = step - 1), when they are present.
fn check_steps(
    model_version: Option<u64>,
    header: Option<&Header>,
    kind: Kind,
    step: u64,
) -> Result<()> {
    if let Some(v) = model_version
        && v != step
    {
        return Err(Error::metadata(
            trl::keys::MODEL_VERSION,
            format!("says step {v}, the object's key says step {step}"),
        ));
    }
    if let Some(h) = header {
        if h.kind != kind {
            return Err(Error::metadata(
                crate::format::keys::KIND,
                format!("a {:?} where the key says {kind:?}", h.kind),
            ));
        }
        if Some(h.model_version) != version_of_step(step) {
            return Err(Error::metadata(
                crate::format::keys::MODEL_VERSION,
                format!(
                    "version {} is not step {step} (TRL steps are weightcast versions + 1)",
                    h.model_version
                ),
            ));
        }
    }
    Ok(())
}

/// Names the object an error came from (keeping the error's kind).
pub fn in_object(key: &str, e: Error) -> Error {
    let at = |s: String| format!("{s} (in `{key}`)");
    match e {
        Error::Container(s) => Error::Container(at(s)),
        Error::Metadata { field, reason } => Error::Metadata {
            field,
            reason: at(reason),
        },
        Error::Tensor { tensor, reason } => Error::Tensor {
            tensor,
            reason: at(reason),
        },
        Error::Unsupported {
            encoding,
            tensor,
            reason,
        } => Error::Unsupported {
            encoding,
            tensor,
            reason: at(reason),
        },
        Error::BaseMismatch(s) => Error::BaseMismatch(at(s)),
        Error::WrongBase {
            scope,
            expected,
            actual,
        } => Error::WrongBase {
            scope: at(scope),
            expected,
            actual,
        },
        Error::Integrity {
            scope,
            expected,
            actual,
        } => Error::Integrity {
            scope: at(scope),
            expected,
            actual,
        },
        other => other,
    }
}

/// Whether the bucket holds the object a TRL commit token names (`"<key>
/// <size>"`: what a TRL-layout publisher records as its writer).
pub async fn token_present(store: &Store, token: &str) -> Result<bool> {
    let Some((key, size)) = token.rsplit_once(' ') else {
        return Ok(false);
    };
    let size: u64 = size.parse().unwrap_or(u64::MAX);
    // object_store lists by path segments: list the key's folder, starting
    // just before the key (the key is the newest step: little comes after).
    let folder = key.rsplit_once('/').map_or("", |(d, _)| d);
    let before = key.strip_suffix(".safetensors").unwrap_or(key);
    Ok(store
        .list_after(folder, before)
        .await?
        .iter()
        .any(|l| l.key == key && l.size == size))
}

// ---------------------------------------------------------------------------
// Writing (`publish --layout trl`).

fn version_for(step: u64) -> Result<u64> {
    version_of_step(step).ok_or_else(|| Error::Config("TRL steps start at 1".into()))
}

/// The TRL anchor object of `set` at `step` (weightcast version `step - 1`):
/// every tensor, TRL's anchor keys beside weightcast's (digests).
pub fn encode_anchor(
    set: &TensorSet,
    step: u64,
    opts: &TrlOptions,
) -> Result<(Vec<u8>, AnchorSummary)> {
    trl::encode_anchor(set, version_for(step)?, opts)
}

/// The TRL delta object from `base` (the state at the step before) to `new` at
/// `step`, with TRL's delta keys beside weightcast's. `new` gets its digests.
pub fn encode_delta(
    base: &TensorSet,
    new: &mut TensorSet,
    step: u64,
    opts: &TrlOptions,
) -> Result<(Vec<u8>, DeltaSummary)> {
    let version = version_for(step)?;
    let base_version = version
        .checked_sub(1)
        .ok_or_else(|| Error::Config("step 1 is always an anchor in TRL's layout".into()))?;
    let o = DeltaOptions {
        encoding: Encoding::Trl,
        model_version: version,
        base_version,
        trl: *opts,
        ..DeltaOptions::default()
    };
    crate::codec::encode_delta(base, new, &o)
}

/// Encodes and uploads the anchor of `step`; returns its key and summary.
pub async fn put_anchor(
    store: &Store,
    set: &TensorSet,
    step: u64,
    opts: &TrlOptions,
) -> Result<(String, AnchorSummary)> {
    let (bytes, summary) = encode_anchor(set, step, opts)?;
    let key = anchor_key(step);
    store.put(&key, Bytes::from(bytes)).await?;
    Ok((key, summary))
}

/// Encodes and uploads the delta of `step`. As TRL v3 does, a v3 step without
/// any change writes no object (the key is `None`); a v1 step writes an empty
/// delta. Returns the key and the summary either way.
pub async fn put_delta(
    store: &Store,
    base: &TensorSet,
    new: &mut TensorSet,
    step: u64,
    opts: &TrlOptions,
) -> Result<(Option<String>, DeltaSummary)> {
    let (bytes, summary) = encode_delta(base, new, step, opts)?;
    if summary.changed == 0 && opts.generation == TrlGeneration::V3 {
        return Ok((None, summary));
    }
    let key = delta_key(step);
    store.put(&key, Bytes::from(bytes)).await?;
    Ok((Some(key), summary))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_parse_as_trl_writes_them() {
        assert_eq!(anchor_key(1), "anchors/step_000001.safetensors");
        assert_eq!(delta_key(1_234_567), "deltas/step_1234567.safetensors");
        assert_eq!(parse_key(&anchor_key(10)), Some((Kind::Anchor, 10)));
        assert_eq!(
            parse_key(&delta_key(1_234_567)),
            Some((Kind::Delta, 1_234_567))
        );
        for bad in [
            "anchors/step_1.safetensors",
            "anchors/step_0000001.safetensors",
            "anchors/step_00001a.safetensors",
            "anchors/step_000001.safetensors.tmp",
            "anchors/x/step_000001.safetensors",
            "versions/step_000001.safetensors",
            "deltas/step_-00001.safetensors",
            "latest.json",
        ] {
            assert_eq!(parse_key(bad), None, "{bad}");
        }
    }

    #[test]
    fn anchors_follow_trls_rule() {
        let anchors: Vec<u64> = (1..=10).filter(|&s| is_anchor_step(s, 3)).collect();
        assert_eq!(anchors, [1, 3, 6, 9]);
        assert!(is_anchor_step(1, 0) && !is_anchor_step(2, 0));
        assert_eq!(step_of_version(0), 1);
    }
}
