//! The bucket protocol: where objects live and how a version becomes visible.
//!
//! ```text
//! <prefix>/
//!   objects/<version:020>-<writer>/<file>   the version's objects (anchors, deltas, other files)
//!   versions/<version:020>.json             the commit manifest: written last, create-if-absent
//!   latest.json                             hint: the newest committed version (overwritten)
//! ```
//!
//! A version exists exactly when `versions/<version>.json` exists. Its objects
//! are uploaded first under a key unique to the writer (`<writer>` is random per
//! publish attempt), so two publishers racing for a version never overwrite
//! each other's objects; the manifest is then created with a conditional
//! create, which exactly one of them wins (delta-rs commits its log the same
//! way). A manifest names every object with its size and BLAKE3, so a reader
//! never sees a partial version and can check every byte it downloads.
//!
//! `latest.json` lets a subscriber learn the newest version with one small
//! conditional GET per poll. It is only a hint: it is written after the commit
//! (a crash in between leaves it one version behind until the next publish, or
//! until [`repair_latest`]), and readers that need certainty list `versions/`
//! after the version they know ([`versions_after`]).

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::store::{Created, Fetched, Store};

/// Value of [`Manifest::format`].
pub const MANIFEST_FORMAT: &str = "weightcast-manifest/1";
/// Key of the newest-version hint.
pub const LATEST_KEY: &str = "latest.json";
/// Prefix of the commit manifests.
pub const VERSIONS_PREFIX: &str = "versions";
/// Prefix of the versions' objects.
pub const OBJECTS_PREFIX: &str = "objects";
/// Largest manifest a reader accepts (a manifest lists files, not tensors).
pub const MAX_MANIFEST_BYTES: usize = 16 << 20;

/// Key of the manifest of `version`.
pub fn manifest_key(version: u64) -> String {
    format!("{VERSIONS_PREFIX}/{version:020}.json")
}

/// Key prefix of the objects one writer uploads for `version`.
pub fn objects_prefix(version: u64, writer: &str) -> String {
    format!("{OBJECTS_PREFIX}/{version:020}-{writer}")
}

/// A fresh writer token: 16 hex digits from the clock, the process and a counter.
pub fn writer_token() -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let seed = format!(
        "{:?}/{}/{}",
        std::time::SystemTime::now(),
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    );
    blake3::hash(seed.as_bytes()).to_hex()[..16].to_string()
}

/// Parses a manifest key back into its version.
pub fn version_of_manifest_key(key: &str) -> Option<u64> {
    let name = key.strip_prefix(VERSIONS_PREFIX)?.strip_prefix('/')?;
    let digits = name.strip_suffix(".json")?;
    (digits.len() == 20 && digits.bytes().all(|b| b.is_ascii_digit()))
        .then(|| digits.parse().ok())
        .flatten()
}

/// What kind of version a manifest commits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum VersionKind {
    /// Full weights: replaying starts here.
    Anchor,
    /// Changes relative to `base_version`.
    Delta,
}

/// What one object of a version is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ObjectRole {
    /// A full safetensors file (weightcast anchor format).
    Anchor,
    /// A delta for the safetensors file `name`.
    Delta,
    /// A non-tensor file (config, tokenizer, index), copied as is.
    File,
}

/// One object of a version.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ObjectEntry {
    /// The checkpoint file this object materializes (e.g. `model-00001-of-00002.safetensors`).
    pub name: String,
    /// What the object is.
    pub role: ObjectRole,
    /// Key relative to the store's prefix.
    pub key: String,
    /// Size in bytes.
    pub size: u64,
    /// BLAKE3 of the object's bytes, 64 hex digits.
    pub blake3: String,
}

/// A commit: everything a reader needs to materialize one version.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    /// [`MANIFEST_FORMAT`].
    pub format: String,
    /// The version committed.
    pub version: u64,
    /// Anchor or delta.
    pub kind: VersionKind,
    /// The version its delta objects apply to (always `version - 1`): present
    /// on every delta, and on an anchor that also carries *bridge* deltas from
    /// the version before it, so that a subscriber behind the anchor can replay
    /// across it instead of downloading it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base_version: Option<u64>,
    /// The newest anchor at or before this version.
    pub anchor_version: u64,
    /// The writer token of the objects.
    pub writer: String,
    /// The version's objects.
    pub objects: Vec<ObjectEntry>,
}

impl Manifest {
    /// Parses and validates a manifest read from the bucket (untrusted).
    pub fn parse(bytes: &[u8]) -> Result<Manifest> {
        if bytes.len() > MAX_MANIFEST_BYTES {
            return Err(Error::metadata("manifest", "larger than 16 MiB"));
        }
        let m: Manifest = serde_json::from_slice(bytes)
            .map_err(|e| Error::metadata("manifest", e.to_string()))?;
        m.validate()?;
        Ok(m)
    }

    /// Checks the invariants a reader relies on.
    pub fn validate(&self) -> Result<()> {
        let bad = |what: String| Err(Error::metadata("manifest", what));
        if self.format != MANIFEST_FORMAT {
            return bad(format!(
                "format `{}` is not `{MANIFEST_FORMAT}`",
                self.format
            ));
        }
        let follows = |b: u64| Some(b) == self.version.checked_sub(1);
        match (self.kind, self.base_version) {
            (VersionKind::Anchor, None) if self.anchor_version == self.version => {}
            (VersionKind::Anchor, Some(b)) if self.anchor_version == self.version && follows(b) => {
            }
            (VersionKind::Delta, Some(b)) if follows(b) && self.anchor_version < self.version => {}
            _ => {
                return bad(format!(
                    "inconsistent version {}, kind {:?}, base {:?}, anchor {}",
                    self.version, self.kind, self.base_version, self.anchor_version
                ));
            }
        }
        let own = objects_prefix(self.version, &self.writer);
        // A name appears once, except that an anchor with bridges lists a
        // safetensors file twice: as an anchor object and as a delta object.
        let mut names = std::collections::HashSet::new();
        for o in &self.objects {
            let slot = match o.role {
                ObjectRole::Delta => 1u8,
                ObjectRole::Anchor | ObjectRole::File => 0,
            };
            if !names.insert((o.name.as_str(), slot)) {
                return bad(format!("file `{}` listed twice", o.name));
            }
            if o.role == ObjectRole::File && names.contains(&(o.name.as_str(), 1)) {
                return bad(format!("file `{}` listed twice", o.name));
            }
            if !is_safe_file_name(&o.name) {
                return bad(format!(
                    "file name `{}` is not a plain relative path",
                    o.name
                ));
            }
            if o.key
                .strip_prefix(&own)
                .and_then(|r| r.strip_prefix('/'))
                .is_none()
            {
                return bad(format!("object `{}` is outside {own}/", o.key));
            }
            if o.blake3.len() != 64 || !o.blake3.bytes().all(|b| b.is_ascii_hexdigit()) {
                return bad(format!("object `{}`: blake3 is not 64 hex digits", o.key));
            }
            let allowed = match (self.kind, o.role) {
                (VersionKind::Anchor, ObjectRole::Delta) => self.base_version.is_some(),
                (VersionKind::Delta, ObjectRole::Anchor) => false,
                _ => true,
            };
            if !allowed {
                return bad(format!(
                    "{:?} version lists {:?} object `{}`",
                    self.kind, o.role, o.key
                ));
            }
        }
        if self.kind == VersionKind::Anchor && self.base_version.is_some() {
            // Bridges must cover every anchor file, or a replay across the
            // anchor would keep a stale file.
            for o in self.objects.iter().filter(|o| o.role == ObjectRole::Anchor) {
                if !names.contains(&(o.name.as_str(), 1)) {
                    return bad(format!("anchor file `{}` has no bridge delta", o.name));
                }
            }
            if let Some(o) = self
                .objects
                .iter()
                .find(|o| o.role == ObjectRole::Delta && !names.contains(&(o.name.as_str(), 0)))
            {
                return bad(format!("bridge delta `{}` has no anchor file", o.name));
            }
        }
        Ok(())
    }

    /// Whether a reader at `version - 1` can reach this version by applying
    /// its delta objects (every delta version, and anchors with bridges).
    pub fn replays_from_previous(&self) -> bool {
        self.base_version.is_some()
    }

    /// The objects a reader applies to reach this version from the one before:
    /// delta objects and non-tensor files.
    pub fn replay_objects(&self) -> impl Iterator<Item = &ObjectEntry> {
        self.objects.iter().filter(|o| o.role != ObjectRole::Anchor)
    }

    /// The objects a reader starting at this anchor downloads: anchor objects
    /// and non-tensor files.
    pub fn bootstrap_objects(&self) -> impl Iterator<Item = &ObjectEntry> {
        self.objects.iter().filter(|o| o.role != ObjectRole::Delta)
    }

    /// Bytes of [`Manifest::replay_objects`].
    pub fn replay_bytes(&self) -> u64 {
        self.replay_objects().map(|o| o.size).sum()
    }

    /// Bytes of [`Manifest::bootstrap_objects`].
    pub fn bootstrap_bytes(&self) -> u64 {
        self.bootstrap_objects().map(|o| o.size).sum()
    }
}

/// Whether `name` is a relative path of plain components (no `..`, no absolute
/// path, no empty component, no backslash): safe to join under an output
/// directory.
pub fn is_safe_file_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 1024
        && !name.starts_with('/')
        && !name.contains('\\')
        && !name.contains('\0')
        && name
            .split('/')
            .all(|c| !c.is_empty() && c != "." && c != "..")
}

/// The newest-version hint.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Latest {
    /// The newest committed version known to the writer of the hint.
    pub version: u64,
    /// Its newest anchor.
    pub anchor_version: u64,
}

/// Outcome of [`commit`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Commit {
    /// This manifest is now the version.
    Committed,
    /// Another writer committed this version first; nothing of ours is visible.
    VersionTaken,
}

/// Uploads one object of a version, at `objects/<version>-<writer>/<name>`,
/// and returns its manifest entry.
pub async fn upload_object(
    store: &Store,
    version: u64,
    writer: &str,
    name: &str,
    role: ObjectRole,
    bytes: Bytes,
) -> Result<ObjectEntry> {
    upload_at(store, version, writer, "", name, role, bytes).await
}

/// Uploads the file at `path` — `size` bytes with BLAKE3 `blake3`, computed
/// when it was written — as object `name` of a version, streaming it in parts.
#[allow(clippy::too_many_arguments)]
pub async fn upload_file(
    store: &Store,
    version: u64,
    writer: &str,
    name: &str,
    role: ObjectRole,
    path: &std::path::Path,
    size: u64,
    blake3: String,
) -> Result<ObjectEntry> {
    if !is_safe_file_name(name) {
        return Err(Error::Config(format!(
            "file name `{name}` is not a plain relative path"
        )));
    }
    let key = format!("{}/{name}", objects_prefix(version, writer));
    store.put_file(&key, path).await?;
    Ok(ObjectEntry {
        name: name.to_string(),
        role,
        key,
        size,
        blake3,
    })
}

/// Uploads an anchor's bridge delta for file `name`, at
/// `objects/<version>-<writer>/bridge/<name>` (beside the anchor object of the
/// same name), and returns its manifest entry.
pub async fn upload_bridge(
    store: &Store,
    version: u64,
    writer: &str,
    name: &str,
    bytes: Bytes,
) -> Result<ObjectEntry> {
    upload_at(
        store,
        version,
        writer,
        "bridge/",
        name,
        ObjectRole::Delta,
        bytes,
    )
    .await
}

async fn upload_at(
    store: &Store,
    version: u64,
    writer: &str,
    dir: &str,
    name: &str,
    role: ObjectRole,
    bytes: Bytes,
) -> Result<ObjectEntry> {
    if !is_safe_file_name(name) {
        return Err(Error::Config(format!(
            "file name `{name}` is not a plain relative path"
        )));
    }
    let key = format!("{}/{dir}{name}", objects_prefix(version, writer));
    let entry = ObjectEntry {
        name: name.to_string(),
        role,
        key: key.clone(),
        size: bytes.len() as u64,
        blake3: blake3::hash(&bytes).to_hex().to_string(),
    };
    store.put(&key, bytes).await?;
    Ok(entry)
}

/// Makes a version visible: creates its manifest if no other writer has. Call
/// after every object of the manifest is uploaded. On stores that ignore
/// conditional writes two writers can both see `Committed` — publishers must
/// refuse such stores (see [`Store::probe_conditional_writes`]) unless the
/// operator vouches for a single writer.
pub async fn commit(store: &Store, manifest: &Manifest) -> Result<Commit> {
    manifest.validate()?;
    let body = serde_json::to_vec_pretty(manifest).expect("manifest serializes");
    match store
        .create(&manifest_key(manifest.version), Bytes::from(body))
        .await?
    {
        Created::Created => Ok(Commit::Committed),
        Created::AlreadyExists => Ok(Commit::VersionTaken),
    }
}

/// Overwrites the newest-version hint.
pub async fn write_latest(store: &Store, latest: &Latest) -> Result<()> {
    let body = serde_json::to_vec(latest).expect("latest serializes");
    store.put(LATEST_KEY, Bytes::from(body)).await
}

/// Reads the hint unless it still has ETag `known`. `Ok(None)` when nothing
/// changed or no hint exists yet; otherwise the hint and its new ETag.
pub async fn read_latest(
    store: &Store,
    known: Option<&str>,
) -> Result<Option<(Latest, Option<String>)>> {
    match store.fetch_at_most(LATEST_KEY, known, 4096).await? {
        Fetched::NotModified | Fetched::Missing => Ok(None),
        Fetched::Body { bytes, etag } => {
            let l: Latest = serde_json::from_slice(&bytes)
                .map_err(|e| Error::metadata(LATEST_KEY, e.to_string()))?;
            Ok(Some((l, etag)))
        }
    }
}

/// Reads and validates the manifest of `version`; `None` if not committed.
pub async fn read_manifest(store: &Store, version: u64) -> Result<Option<Manifest>> {
    let Some(bytes) = store
        .get_at_most(&manifest_key(version), MAX_MANIFEST_BYTES as u64)
        .await?
    else {
        return Ok(None);
    };
    let m = Manifest::parse(&bytes)?;
    if m.version != version {
        return Err(Error::metadata(
            "manifest",
            format!("{} holds version {}", manifest_key(version), m.version),
        ));
    }
    Ok(Some(m))
}

/// Committed versions newer than `after` (all when `None`), ascending.
pub async fn versions_after(store: &Store, after: Option<u64>) -> Result<Vec<u64>> {
    let listed = match after {
        Some(a) => store.list_after(VERSIONS_PREFIX, &manifest_key(a)).await?,
        None => store.list(VERSIONS_PREFIX).await?,
    };
    let mut v: Vec<u64> = listed
        .iter()
        .filter_map(|l| version_of_manifest_key(&l.key))
        .filter(|&v| after.is_none_or(|a| v > a))
        .collect();
    v.sort_unstable();
    Ok(v)
}

/// Rewrites `latest.json` from the committed manifests (after a crash between
/// a commit and its hint). Returns the newest version, if any.
pub async fn repair_latest(store: &Store) -> Result<Option<Latest>> {
    let Some(&newest) = versions_after(store, None).await?.last() else {
        return Ok(None);
    };
    let m = read_manifest(store, newest)
        .await?
        .ok_or_else(|| Error::metadata("manifest", format!("version {newest} vanished")))?;
    let latest = Latest {
        version: newest,
        anchor_version: m.anchor_version,
    };
    write_latest(store, &latest).await?;
    Ok(Some(latest))
}

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
/// the newest commit, which a publisher may be uploading right now. Other
/// subscribers behind the kept range re-bootstrap from a kept anchor.
pub async fn collect_garbage(
    store: &Store,
    retention: &Retention,
    dry_run: bool,
) -> Result<Collected> {
    let keep_anchors = retention.keep_anchors;
    if keep_anchors == 0 {
        return Err(Error::Config("keep at least one anchor".into()));
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
        for r in crate::notify::registrations(store).await? {
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
    for l in store.list(OBJECTS_PREFIX).await? {
        if referenced.contains(l.key.as_str()) {
            continue;
        }
        // objects/<version:020>-<writer>/<file>
        let version = l
            .key
            .strip_prefix(OBJECTS_PREFIX)
            .and_then(|r| r.strip_prefix('/'))
            .and_then(|r| r.get(..20))
            .and_then(|d| d.parse::<u64>().ok());
        match version {
            Some(v) if v <= newest => {}
            // In flight (or not ours to judge): leave it.
            _ => continue,
        }
        out.objects += 1;
        out.bytes += l.size;
        if !dry_run {
            store.delete(&l.key).await?;
        }
    }
    Ok(out)
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

#[cfg(test)]
mod tests {
    use super::*;

    fn manifest(version: u64, writer: &str) -> Manifest {
        Manifest {
            format: MANIFEST_FORMAT.into(),
            version,
            kind: if version == 0 {
                VersionKind::Anchor
            } else {
                VersionKind::Delta
            },
            base_version: version.checked_sub(1),
            anchor_version: 0,
            writer: writer.into(),
            objects: vec![ObjectEntry {
                name: "model.safetensors".into(),
                role: if version == 0 {
                    ObjectRole::Anchor
                } else {
                    ObjectRole::Delta
                },
                key: format!("{}/model.safetensors", objects_prefix(version, writer)),
                size: 1,
                blake3: "0".repeat(64),
            }],
        }
    }

    #[test]
    fn keys_sort_numerically_and_parse_back() {
        assert!(manifest_key(9) < manifest_key(10));
        assert_eq!(version_of_manifest_key(&manifest_key(123)), Some(123));
        assert_eq!(version_of_manifest_key("versions/12.json"), None);
        assert_eq!(
            version_of_manifest_key("versions/0000000000000000001x.json"),
            None
        );
    }

    #[test]
    fn manifests_are_validated() {
        let good = manifest(3, "w");
        let bytes = serde_json::to_vec(&good).unwrap();
        assert_eq!(Manifest::parse(&bytes).unwrap(), good);
        let mut m = good.clone();
        m.objects[0].name = "../../etc/passwd".into();
        assert!(
            m.validate()
                .unwrap_err()
                .to_string()
                .contains("plain relative path")
        );
        let mut m = good.clone();
        m.objects[0].key = "objects/00000000000000000003-other/model.safetensors".into();
        assert!(m.validate().unwrap_err().to_string().contains("outside"));
        let mut m = good.clone();
        m.base_version = Some(1);
        assert!(m.validate().is_err());
        let mut m = good.clone();
        m.objects.push(m.objects[0].clone());
        assert!(m.validate().unwrap_err().to_string().contains("twice"));
        assert!(Manifest::parse(b"{\"format\": 1}").is_err());

        // Anchors with bridges: every anchor file has its delta and vice versa.
        let mut anchor = manifest(4, "w");
        anchor.kind = VersionKind::Anchor;
        anchor.anchor_version = 4;
        anchor.base_version = None;
        anchor.objects[0].role = ObjectRole::Anchor;
        anchor.validate().unwrap();
        let mut bridged = anchor.clone();
        bridged.base_version = Some(3);
        assert!(
            bridged
                .validate()
                .unwrap_err()
                .to_string()
                .contains("no bridge")
        );
        let mut bridge = anchor.objects[0].clone();
        bridge.role = ObjectRole::Delta;
        bridge.key = format!("{}/bridge", objects_prefix(4, "w"));
        bridged.objects.push(bridge.clone());
        bridged.validate().unwrap();
        assert!(bridged.replays_from_previous() && !anchor.replays_from_previous());
        assert_eq!(bridged.replay_objects().count(), 1);
        assert_eq!(bridged.bootstrap_objects().count(), 1);
        let mut m = bridged.clone();
        m.base_version = Some(2);
        assert!(m.validate().is_err());
        let mut m = anchor.clone();
        m.objects.push(bridge.clone());
        assert!(
            m.validate()
                .unwrap_err()
                .to_string()
                .contains("Delta object")
        );
        let mut m = bridged.clone();
        m.objects.retain(|o| o.role == ObjectRole::Delta);
        assert!(
            m.validate()
                .unwrap_err()
                .to_string()
                .contains("no anchor file")
        );
        let mut m = bridged.clone();
        m.objects.push(bridge.clone());
        assert!(m.validate().unwrap_err().to_string().contains("twice"));
        let mut m = bridged.clone();
        let mut file = bridge;
        file.role = ObjectRole::File;
        m.objects.push(file);
        assert!(m.validate().unwrap_err().to_string().contains("twice"));
        assert!(Manifest::parse(&vec![b' '; MAX_MANIFEST_BYTES + 1]).is_err());
    }

    #[test]
    fn file_names() {
        for ok in ["model.safetensors", "sub/dir/tokenizer.json"] {
            assert!(is_safe_file_name(ok), "{ok}");
        }
        for bad in ["", "/abs", "a/../b", "..", "a//b", "./a", "a\\b", "a\0b"] {
            assert!(!is_safe_file_name(bad), "{bad:?}");
        }
    }
}
