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
    /// For deltas: the version they apply to (always `version - 1`).
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
        match (self.kind, self.base_version) {
            (VersionKind::Anchor, None) if self.anchor_version == self.version => {}
            (VersionKind::Delta, Some(b))
                if Some(b) == self.version.checked_sub(1) && self.anchor_version < self.version => {
            }
            _ => {
                return bad(format!(
                    "inconsistent version {}, kind {:?}, base {:?}, anchor {}",
                    self.version, self.kind, self.base_version, self.anchor_version
                ));
            }
        }
        let own = objects_prefix(self.version, &self.writer);
        let mut names = std::collections::HashSet::new();
        for o in &self.objects {
            if !names.insert(o.name.as_str()) {
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
            let allowed = match self.kind {
                VersionKind::Anchor => o.role != ObjectRole::Delta,
                VersionKind::Delta => true,
            };
            if !allowed {
                return bad(format!("anchor version lists delta object `{}`", o.key));
            }
        }
        Ok(())
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

/// Uploads one object of a version and returns its manifest entry.
pub async fn upload_object(
    store: &Store,
    version: u64,
    writer: &str,
    name: &str,
    role: ObjectRole,
    bytes: Bytes,
) -> Result<ObjectEntry> {
    if !is_safe_file_name(name) {
        return Err(Error::Config(format!(
            "file name `{name}` is not a plain relative path"
        )));
    }
    let key = format!("{}/{name}", objects_prefix(version, writer));
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
    let mut v: Vec<u64> = store
        .list(VERSIONS_PREFIX)
        .await?
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

/// What a garbage collection removed (or would remove, in a dry run).
#[derive(Clone, Debug, Default, Serialize, PartialEq, Eq)]
pub struct Collected {
    /// The oldest version kept (every version before it is gone).
    pub keep_from: Option<u64>,
    /// Versions whose manifests were removed.
    pub versions: Vec<u64>,
    /// Objects removed (of removed versions, and objects no manifest references).
    pub objects: u64,
    /// Bytes those objects held.
    pub bytes: u64,
}

/// Retention: keeps the newest `keep_anchors` anchors and every version after
/// the oldest of them; removes older versions (manifest first, so a version
/// vanishes at once, then its objects) and objects that no manifest references
/// (a losing writer's uploads), except those of versions newer than the newest
/// commit, which a publisher may be uploading right now. Subscribers behind the
/// kept range re-bootstrap from a kept anchor.
pub async fn collect_garbage(
    store: &Store,
    keep_anchors: usize,
    dry_run: bool,
) -> Result<Collected> {
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
    let keep_from = if anchors.len() >= keep_anchors {
        anchors[anchors.len() - keep_anchors]
    } else {
        anchors.first().copied().unwrap_or(0)
    };
    let mut out = Collected {
        keep_from: Some(keep_from),
        ..Collected::default()
    };
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
