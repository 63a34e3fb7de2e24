//! The planner: from the held version (or none) and the target version's
//! manifest, decide whether to replay the versions in between (deltas, across
//! bridged anchors) or to start from the target's anchor and replay after it.
//!
//! [`choose`] is pure (manifests in, plan out); [`plan`] reads the manifests
//! it needs — concurrently, each once — and hands them on with the plan, so
//! executing it reads no manifest again.

use std::collections::BTreeMap;

use futures::StreamExt;

use crate::error::{Error, Result};
use crate::protocol::Manifest;

use super::fetch::Fetcher;

/// Longest replay considered before jumping to the anchor regardless.
pub const MAX_REPLAY_VERSIONS: u64 = 1000;

/// Manifests read concurrently while planning.
const MANIFESTS_IN_FLIGHT: usize = 8;

/// How to reach the target version.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Plan {
    /// The held version is the target.
    UpToDate,
    /// Apply these versions' delta and file objects to the held version, in order.
    Replay(Vec<u64>),
    /// Start from the anchor of version `anchor`, then replay `replay`.
    Bootstrap {
        /// The anchor version.
        anchor: u64,
        /// The versions after it, up to the target.
        replay: Vec<u64>,
    },
}

impl Plan {
    /// Every version whose manifest executing the plan needs.
    pub fn versions(&self) -> Vec<u64> {
        match self {
            Plan::UpToDate => Vec::new(),
            Plan::Replay(v) => v.clone(),
            Plan::Bootstrap { anchor, replay } => std::iter::once(*anchor)
                .chain(replay.iter().copied())
                .collect(),
        }
    }
}

/// The versions whose manifests [`choose`] looks at, for `held` and a target
/// version `target` whose newest anchor is `anchor`.
pub fn needed(held: Option<u64>, target: u64, anchor: u64) -> std::ops::RangeInclusive<u64> {
    match held {
        // Replaying from h needs h+1..=target (the anchor among them when
        // h is behind it, for the cost comparison).
        Some(h) if h < target && target - h <= MAX_REPLAY_VERSIONS => h + 1..=target,
        _ => anchor..=target,
    }
}

/// Decides how to reach `target` from `held`, given the manifests of
/// [`needed`] (a missing one means that way is not possible). Replays when it
/// costs fewer bytes than the anchor and the replay after it; any doubt (a
/// missing manifest, a version that cannot be replayed into) means bootstrap.
pub fn choose(held: Option<u64>, target: &Manifest, chain: &BTreeMap<u64, Manifest>) -> Plan {
    let t = target.version;
    let anchor = target.anchor_version;
    let bootstrap = Plan::Bootstrap {
        anchor,
        replay: (anchor + 1..=t).collect(),
    };
    let Some(h) = held else {
        return bootstrap;
    };
    if h == t {
        return Plan::UpToDate;
    }
    if h > t || t - h > MAX_REPLAY_VERSIONS {
        return bootstrap;
    }
    let versions: Vec<u64> = (h + 1..=t).collect();
    let replayable = versions
        .iter()
        .all(|v| chain.get(v).is_some_and(Manifest::replays_from_previous));
    if !replayable {
        return bootstrap;
    }
    if h >= anchor {
        // Only deltas lie between; the publisher bounds them below an anchor.
        return Plan::Replay(versions);
    }
    let replay: u64 = versions.iter().map(|v| chain[v].replay_bytes()).sum();
    let start: u64 = chain[&anchor].bootstrap_bytes()
        + (anchor + 1..=t)
            .map(|v| chain[&v].replay_bytes())
            .sum::<u64>();
    if replay < start {
        Plan::Replay(versions)
    } else {
        bootstrap
    }
}

/// Reads the manifests of `versions` concurrently; a version that is not
/// committed is simply absent from the map. With `skip_corrupt`, a manifest
/// that is unreadable (malformed, or stored under another version's key) is
/// also left out, with a warning: the planner then treats that way as
/// impossible (doubt means bootstrap) instead of failing a catch-up that may
/// not need it.
pub async fn read_manifests(
    f: &Fetcher,
    versions: impl IntoIterator<Item = u64>,
    skip_corrupt: bool,
) -> Result<BTreeMap<u64, Manifest>> {
    let mut out = BTreeMap::new();
    let mut reads = futures::stream::iter(versions)
        .map(|v| async move { (v, f.manifest(v).await) })
        .buffered(MANIFESTS_IN_FLIGHT);
    while let Some((v, r)) = reads.next().await {
        match r {
            Ok(Some(m)) => {
                out.insert(v, m);
            }
            Ok(None) => {}
            Err(e) if skip_corrupt && e.kind() == crate::error::ErrorKind::Corrupt => {
                tracing::warn!(version = v, error = %e, "unreadable manifest; not replaying through it");
            }
            Err(e) => return Err(e),
        }
    }
    Ok(out)
}

/// Plans the way from `held` to `target` and returns the plan with the
/// manifests it needs (every one present: a missing manifest is an error
/// naming the version).
pub async fn plan(
    f: &Fetcher,
    held: Option<u64>,
    target: u64,
) -> Result<(Plan, BTreeMap<u64, Manifest>)> {
    let t = f
        .manifest(target)
        .await?
        .ok_or_else(|| Error::NotFound(format!("version {target} vanished while being read")))?;
    let mut chain = read_manifests(
        f,
        needed(held, target, t.anchor_version).filter(|&v| v != target),
        true,
    )
    .await?;
    chain.insert(target, t);
    let p = choose(held, &chain[&target], &chain);
    complete(f, &p, &mut chain).await?;
    Ok((p, chain))
}

/// Reads whatever manifests `p` needs that `chain` lacks; errors when one is
/// not committed (a gap in the bucket).
pub async fn complete(f: &Fetcher, p: &Plan, chain: &mut BTreeMap<u64, Manifest>) -> Result<()> {
    let missing: Vec<u64> = p
        .versions()
        .into_iter()
        .filter(|v| !chain.contains_key(v))
        .collect();
    chain.extend(read_manifests(f, missing, false).await?);
    if let Some(v) = p.versions().into_iter().find(|v| !chain.contains_key(v)) {
        return Err(Error::NotFound(format!(
            "version {v} is missing from `{}` (a gap in the versions)",
            f.store().url()
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{MANIFEST_FORMAT, ObjectEntry, ObjectRole, VersionKind, object_key};

    /// A manifest of `version` whose newest anchor is `anchor`, with one
    /// tensor object of `bytes` (an anchor, a delta, or both when bridged).
    fn manifest(version: u64, anchor: u64, bridged: bool, bytes: u64) -> Manifest {
        let entry = |role| ObjectEntry {
            name: "model.safetensors".into(),
            role,
            key: object_key(role, version, "w", "model.safetensors").unwrap(),
            size: bytes,
            blake3: "0".repeat(64),
        };
        let (kind, objects) = if version == anchor {
            let mut o = vec![entry(ObjectRole::Anchor)];
            if bridged {
                o.push(ObjectEntry {
                    size: bytes / 50,
                    ..entry(ObjectRole::Delta)
                });
            }
            (VersionKind::Anchor, o)
        } else {
            (VersionKind::Delta, vec![entry(ObjectRole::Delta)])
        };
        let m = Manifest {
            format: MANIFEST_FORMAT.into(),
            version,
            kind,
            base_version: (version != anchor || bridged)
                .then(|| version.checked_sub(1))
                .flatten(),
            anchor_version: anchor,
            step: None,
            writer: "w".into(),
            objects,
            files: Vec::new(),
        };
        m.validate().unwrap();
        m
    }

    /// Versions 0..=n: anchors every `every` (bridged), deltas of `delta` bytes,
    /// anchors of 1000 bytes.
    fn chain(n: u64, every: u64, delta: u64) -> BTreeMap<u64, Manifest> {
        (0..=n)
            .map(|v| {
                let anchor = v - v % every;
                let bytes = if v == anchor { 1000 } else { delta };
                (v, manifest(v, anchor, v > 0, bytes))
            })
            .collect()
    }

    #[test]
    fn fresh_and_up_to_date() {
        let c = chain(7, 5, 10);
        assert_eq!(
            choose(None, &c[&7], &c),
            Plan::Bootstrap {
                anchor: 5,
                replay: vec![6, 7]
            }
        );
        assert_eq!(choose(Some(7), &c[&7], &c), Plan::UpToDate);
        assert_eq!(needed(None, 7, 5), 5..=7);
        assert_eq!(needed(Some(7), 7, 5), 5..=7);
    }

    #[test]
    fn deltas_after_the_anchor_replay() {
        let c = chain(9, 5, 10);
        assert_eq!(choose(Some(6), &c[&9], &c), Plan::Replay(vec![7, 8, 9]));
        assert_eq!(needed(Some(6), 9, 5), 7..=9);
    }

    #[test]
    fn across_a_bridged_anchor_only_when_cheaper() {
        // Bridge deltas are 1000/50 = 20 bytes.
        let cheap = chain(7, 5, 10);
        assert_eq!(needed(Some(3), 7, 5), 4..=7);
        assert_eq!(
            choose(Some(3), &cheap[&7], &cheap),
            Plan::Replay(vec![4, 5, 6, 7])
        );
        // Deltas of 400 bytes: replaying 4..=7 costs 1220, the anchor 1000 + 800.
        let dear = chain(7, 5, 400);
        assert!(matches!(
            choose(Some(1), &dear[&7], &dear),
            Plan::Bootstrap { anchor: 5, .. }
        ));
        assert_eq!(
            choose(Some(3), &dear[&7], &dear),
            Plan::Replay(vec![4, 5, 6, 7])
        );
    }

    #[test]
    fn doubt_means_bootstrap() {
        let mut c = chain(7, 5, 10);
        // An unbridged anchor cannot be replayed into.
        c.insert(5, manifest(5, 5, false, 1000));
        assert!(matches!(
            choose(Some(3), &c[&7], &c),
            Plan::Bootstrap { anchor: 5, .. }
        ));
        // A missing manifest in between (collected, or not read).
        let mut c = chain(7, 5, 10);
        c.remove(&4);
        assert!(matches!(
            choose(Some(3), &c[&7], &c),
            Plan::Bootstrap { .. }
        ));
        // Held ahead of the bucket (a reset bucket): follow the bucket.
        let c = chain(7, 5, 10);
        assert!(matches!(
            choose(Some(9), &c[&7], &c),
            Plan::Bootstrap { anchor: 5, .. }
        ));
        assert_eq!(needed(Some(9), 7, 5), 5..=7);
    }

    #[test]
    fn far_behind_bootstraps_without_reading_the_history() {
        let t = MAX_REPLAY_VERSIONS + 10;
        let c: BTreeMap<u64, Manifest> = [(t, manifest(t, t - 2, false, 10))]
            .into_iter()
            .chain((t - 2..t).map(|v| (v, manifest(v, t - 2, false, 10))))
            .collect();
        assert_eq!(needed(Some(5), t, t - 2), t - 2..=t);
        assert_eq!(
            choose(Some(5), &c[&t], &c),
            Plan::Bootstrap {
                anchor: t - 2,
                replay: vec![t - 1, t]
            }
        );
        assert_eq!(
            Plan::Bootstrap {
                anchor: 3,
                replay: vec![4]
            }
            .versions(),
            vec![3, 4]
        );
    }
}
