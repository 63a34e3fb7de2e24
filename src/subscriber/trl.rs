//! Following a bucket in TRL's own layout (docs/format.md §11): the planner
//! the subscriber's loop uses for a [`Log::Trl`](super::update::Log::Trl)
//! bucket (`anchors/step_*.safetensors`, `deltas/step_*.safetensors`, no
//! commit manifests). Any sink follows one this way: `subscribe` recognizes a
//! TRL bucket by its keys and materializes it in its output slots like any
//! single-file checkpoint (`DIR/current/model.safetensors`).
//!
//! A TRL bucket has no manifests and no checksums, so the planner reads the
//! objects an update needs while it plans — the newest anchor when nothing is
//! held or it is newer than the held step, then every delta after, in step
//! order, each bounded by its listed size — checks what TRL's format allows
//! (and weightcast's digests where a `publish --layout trl` wrote them), and
//! synthesizes for each step the manifest the loop feeds the sink with: step
//! `s` is version `s - 1`, one tensor file [`FILE`], a delta's base the step
//! before it in the bucket (TRL v3 writes nothing for a step without changes,
//! so steps may have gaps). An anchor newer than the held step must hold
//! every tensor the sink holds: TRL PR #5417's periodic anchors hold only the
//! parameters that changed at their step, and loading one would silently
//! drop the others.

use std::collections::BTreeMap;

use crate::codec::trl::{step_of_version, version_of_step};
use crate::error::{Error, Result};
use crate::format::Kind;
use crate::protocol::trl::{
    MAX_ANCHOR_BYTES, anchor_key, delta_key, read_anchor_object, read_delta_object, steps,
};
use crate::protocol::{MANIFEST_FORMAT, Manifest, ObjectEntry, ObjectRole, VersionKind};

use super::fetch::Fetcher;
use super::plan::Plan;
use super::update::{Ready, Update};

/// The file a TRL step is materialized as.
pub const FILE: &str = "model.safetensors";

/// Limits of following a TRL bucket.
#[derive(Clone, Copy, Debug)]
pub struct TrlLimits {
    /// The largest anchor downloaded ([`MAX_ANCHOR_BYTES`] by default); a
    /// delta may be at most 5 times it (every element changed, 8-byte
    /// positions).
    pub max_anchor_bytes: u64,
}

impl Default for TrlLimits {
    fn default() -> TrlLimits {
        TrlLimits {
            max_anchor_bytes: MAX_ANCHOR_BYTES,
        }
    }
}

fn synthetic(
    version: u64,
    kind: VersionKind,
    base: Option<u64>,
    anchor: u64,
    o: ObjectEntry,
) -> Manifest {
    Manifest {
        format: MANIFEST_FORMAT.to_string(),
        version,
        kind,
        base_version: base,
        anchor_version: anchor,
        step: Some(step_of_version(version)),
        writer: "trl".to_string(),
        objects: vec![o],
        files: Vec::new(),
    }
}

/// The newest step's version in a TRL bucket (two listings), `None` when
/// it holds no object.
pub async fn newest(f: &Fetcher) -> Result<Option<u64>> {
    f.count(2);
    let a = steps(f.store(), Kind::Anchor, None).await?;
    let d = steps(f.store(), Kind::Delta, None).await?;
    let newest = a.keys().chain(d.keys()).max().copied();
    newest.map(version).transpose()
}

fn version(step: u64) -> Result<u64> {
    version_of_step(step).ok_or_else(|| Error::metadata("trl", "a TRL step 0 (steps start at 1)"))
}

/// Plans the update from `held` (a weightcast version: step − 1) to the
/// newest step at or below `target` (all when `None`), reading its objects.
/// `held_tensors`: the tensors the sink holds (an anchor over them must hold
/// each); `anchor`: start from the newest anchor even when the held step is
/// newer. `None` when there is nothing newer (or no anchor to start from).
pub async fn plan(
    f: &Fetcher,
    held: Option<u64>,
    target: Option<u64>,
    held_tensors: Option<Vec<String>>,
    anchor: bool,
    limits: &TrlLimits,
) -> Result<Option<Update>> {
    let store = f.store();
    let max_step = target.map_or(u64::MAX, step_of_version);
    f.count(1);
    let anchors: BTreeMap<u64, u64> = steps(store, Kind::Anchor, None)
        .await?
        .into_iter()
        .filter(|(s, _)| *s <= max_step)
        .collect();
    let held_step = held.map(step_of_version);
    let newest_anchor = anchors.iter().next_back().map(|(s, z)| (*s, *z));
    let from = match newest_anchor {
        Some((a, size)) if held_step.is_none_or(|h| a > h || anchor) => Some((a, size)),
        _ if held_step.is_some() => None,
        _ => return Ok(None),
    };
    let base_step = from.map(|(a, _)| a).or(held_step).expect("one of them");
    f.count(1);
    let deltas: Vec<(u64, u64)> = steps(store, Kind::Delta, Some(base_step))
        .await?
        .into_iter()
        .filter(|(s, _)| *s <= max_step)
        .collect();
    if from.is_none() && deltas.is_empty() {
        return Ok(None);
    }
    let mut chain = BTreeMap::new();
    let mut ready = BTreeMap::new();
    let mut structural_only = false;
    let anchor_version = match from {
        Some((a, size)) => {
            let (set, verified, size, hash) =
                read_anchor_object(store, a, size, limits.max_anchor_bytes).await?;
            f.count(1);
            if let Some(names) = held_tensors.filter(|_| held_step.is_some()) {
                complete(&names, held_step.expect("held"), a, &set)?;
            }
            structural_only |= !verified;
            let v = version(a)?;
            let key = anchor_key(a);
            let entry = ObjectEntry {
                name: FILE.to_string(),
                role: ObjectRole::Anchor,
                key: key.clone(),
                size,
                blake3: hash.to_hex().to_string(),
            };
            chain.insert(v, synthetic(v, VersionKind::Anchor, None, v, entry));
            ready.insert(key, Ready::Tensors(set));
            v
        }
        None => 0,
    };
    let mut previous = version(base_step)?;
    let mut replay = Vec::new();
    for (s, size) in deltas {
        let (body, verified) =
            read_delta_object(store, s, size, limits.max_anchor_bytes.saturating_mul(5)).await?;
        f.count(1);
        structural_only |= !verified;
        let v = version(s)?;
        let key = delta_key(s);
        let entry = ObjectEntry {
            name: FILE.to_string(),
            role: ObjectRole::Delta,
            key: key.clone(),
            size: body.len() as u64,
            blake3: blake3::hash(&body).to_hex().to_string(),
        };
        let m = synthetic(v, VersionKind::Delta, Some(previous), anchor_version, entry);
        chain.insert(v, m);
        ready.insert(key, Ready::Bytes(body));
        replay.push(v);
        previous = v;
    }
    let version = previous;
    let (plan, base) = match from {
        Some(_) => (
            Plan::Bootstrap {
                anchor: anchor_version,
                replay,
            },
            None,
        ),
        None => (Plan::Replay(replay), held),
    };
    Ok(Some(Update {
        version,
        target: version,
        base,
        plan,
        chain,
        ready,
        structural_only,
    }))
}

/// A newer anchor must hold every tensor the sink holds.
fn complete(
    held: &[String],
    held_step: u64,
    step: u64,
    anchor: &crate::tensors::TensorSet,
) -> Result<()> {
    let missing: Vec<&String> = held
        .iter()
        .filter(|n| anchor.position(n).is_none())
        .collect();
    if let Some(first) = missing.first() {
        return Err(Error::tensor(
            first.as_str(),
            format!(
                "held at step {held_step} but absent from the step {step} anchor ({} of {} \
                 tensors missing): the anchor is incomplete (TRL PR #5417 writes periodic \
                 anchors with only the changed parameters) and cannot replace the state. Use \
                 anchors that hold every parameter (TRL v3, `publish --layout trl`), or start a \
                 fresh follower if the model really changed (in `{}`)",
                missing.len(),
                held.len(),
                anchor_key(step)
            ),
        ));
    }
    Ok(())
}
