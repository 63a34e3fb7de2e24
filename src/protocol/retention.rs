//! Retention: which versions and objects a bucket keeps, honouring the
//! subscribers that registered as lagging behind.

use serde::Serialize;

use crate::error::{Error, Result};
use crate::store::Store;

use super::commit::{read_manifest, versions_after};
use super::layout::{OBJECT_PREFIXES, manifest_key, parse_object_key};
use super::manifest::{Manifest, VersionKind};

/// What retention keeps.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Retention {
    /// The newest this many anchors, and every version after the oldest of them.
    pub keep_anchors: usize,
    /// Also keep the versions a registered subscriber behind that range needs
    /// to replay to the newest version — when replaying is cheaper for it than
    /// downloading the newest anchor — if its registration was refreshed within
    /// this many seconds. `None`: registrations are not consulted. A stale
    /// registration (a subscriber that went away) pins nothing.
    pub registration_max_age_s: Option<u64>,
}

impl Default for Retention {
    fn default() -> Self {
        Retention {
            keep_anchors: 2,
            registration_max_age_s: Some(24 * 3600),
        }
    }
}

/// What a garbage collection removed (or would remove, in a dry run).
#[derive(Clone, Debug, Default, Serialize, PartialEq, Eq)]
pub struct Collected {
    /// The oldest version kept (every version before it is gone).
    pub keep_from: Option<u64>,
    /// Registered subscribers whose replay kept versions before the anchor
    /// range (id → the version they hold).
    #[serde(skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub kept_for: std::collections::BTreeMap<String, u64>,
    /// Versions whose manifests were removed.
    pub versions: Vec<u64>,
    /// Objects removed (of removed versions, and objects no manifest references).
    pub objects: u64,
    /// Bytes those objects held.
    pub bytes: u64,
}

/// Retention: keeps the newest `keep_anchors` anchors and every version after
/// the oldest of them, plus what fresh registered subscribers behind them need
/// to replay (see [`Retention`]); removes older versions (manifest first, so a
/// version vanishes at once, then its objects) and objects that no manifest
/// references (a losing writer's uploads), except those of versions newer than
/// the newest commit, which a publisher may be uploading right now; and the
/// records of distributed publishes that can no longer commit (see
/// [`PARTS_GRACE_S`]). Other
/// subscribers behind the kept range re-bootstrap from a kept anchor.
pub async fn collect_garbage(
    store: &Store,
    retention: &Retention,
    dry_run: bool,
) -> Result<Collected> {
    let keep_anchors = retention.keep_anchors;
    if keep_anchors == 0 {
        return Err(Error::Config(
            "retention must keep at least one anchor (--keep-anchors 1 or more)".into(),
        ));
    }
    let versions = versions_after(store, None).await?;
    let Some(&newest) = versions.last() else {
        return Ok(Collected::default());
    };
    let mut manifests = std::collections::BTreeMap::new();
    for &v in &versions {
        if let Some(m) = read_manifest(store, v).await? {
            manifests.insert(v, m);
        }
    }
    let anchors: Vec<u64> = manifests
        .values()
        .filter(|m| m.kind == VersionKind::Anchor)
        .map(|m| m.version)
        .collect();
    let mut keep_from = if anchors.len() >= keep_anchors {
        anchors[anchors.len() - keep_anchors]
    } else {
        anchors.first().copied().unwrap_or(0)
    };
    let mut out = Collected::default();
    if let Some(max_age) = retention.registration_max_age_s {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        // The newest manifest may have vanished since the listing (a
        // concurrent GC): then the anchor's cost is unknown and whatever a
        // registered subscriber replays is kept (the conservative choice).
        let bootstrap = manifests
            .get(&newest)
            .and_then(|m| manifests.get(&m.anchor_version))
            .map(|a| {
                a.bootstrap_bytes()
                    + manifests
                        .range(a.version + 1..)
                        .map(|(_, m)| m.replay_bytes())
                        .sum::<u64>()
            })
            .unwrap_or(u64::MAX);
        for r in super::registry::registrations(store).await? {
            let Some(held) = r.version else { continue };
            if now.saturating_sub(r.updated_at) > max_age || held >= newest || held + 1 >= keep_from
            {
                continue;
            }
            if let Some(replay) = replay_cost(&manifests, held, newest)
                && replay < bootstrap
            {
                keep_from = keep_from.min(held + 1);
                out.kept_for.insert(r.id, held);
            }
        }
    }
    out.keep_from = Some(keep_from);
    // Objects referenced by the versions we keep.
    let referenced: std::collections::HashSet<&str> = manifests
        .range(keep_from..)
        .flat_map(|(_, m)| m.objects.iter().map(|o| o.key.as_str()))
        .collect();
    for &v in manifests.keys().filter(|&&v| v < keep_from) {
        out.versions.push(v);
        if !dry_run {
            store.delete(&manifest_key(v)).await?;
        }
    }
    for prefix in OBJECT_PREFIXES {
        for l in store.list(prefix).await? {
            if referenced.contains(l.key.as_str()) {
                continue;
            }
            match parse_object_key(&l.key) {
                Some(k) if k.version <= newest => {}
                // In flight (or not ours to judge): leave it.
                _ => continue,
            }
            out.objects += 1;
            out.bytes += l.size;
            if !dry_run {
                store.delete(&l.key).await?;
            }
        }
    }
    collect_parts(store, newest, dry_run, &mut out).await?;
    Ok(out)
}

/// How long the records of a distributed publish newer than the newest
/// commit are left alone (ranks may still be uploading that version).
pub const PARTS_GRACE_S: u64 = 3600;

/// Removes distributed-publish records (`parts/`) that can no longer lead to
/// a commit: those of versions at or before the newest committed one, and
/// those of newer versions written more than [`PARTS_GRACE_S`] ago (an
/// abandoned attempt). Unreadable records past the newest are left alone.
async fn collect_parts(
    store: &Store,
    newest: u64,
    dry_run: bool,
    out: &mut Collected,
) -> Result<()> {
    use super::parts::{PARTS_PREFIX, read_record, version_of_parts_key};
    let now = super::registry::unix_now();
    for l in store.list(PARTS_PREFIX).await? {
        let Some(v) = version_of_parts_key(&l.key) else {
            continue;
        };
        if v > newest {
            #[derive(serde::Deserialize)]
            struct Stamp {
                created_at: u64,
            }
            match read_record::<Stamp>(store, &l.key).await {
                Ok(Some(s)) if now.saturating_sub(s.created_at) > PARTS_GRACE_S => {}
                _ => continue,
            }
        }
        out.objects += 1;
        out.bytes += l.size;
        if !dry_run {
            store.delete(&l.key).await?;
        }
    }
    Ok(())
}

/// Bytes a reader at `held` downloads to replay to `newest`, if every version
/// in between is committed and replayable from the one before.
fn replay_cost(
    manifests: &std::collections::BTreeMap<u64, Manifest>,
    held: u64,
    newest: u64,
) -> Option<u64> {
    let mut bytes = 0u64;
    for v in held + 1..=newest {
        let m = manifests.get(&v)?;
        if m.base_version != Some(v - 1) {
            return None;
        }
        bytes += m.replay_bytes();
    }
    Some(bytes)
}
