//! Writing and reading versions: objects first, then the manifest with a
//! create-if-absent write (exactly one writer wins a version), then the
//! `latest.json` hint.

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::store::{Created, Fetched, Store};

use super::layout::{
    LATEST_KEY, VERSIONS_PREFIX, manifest_key, object_key, version_of_manifest_key, writer_token,
};
use super::manifest::{
    FileRef, MANIFEST_FORMAT, MAX_MANIFEST_BYTES, Manifest, ObjectEntry, ObjectRole, VersionKind,
};

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

/// A version being written by one writer: knows where each of its objects
/// goes and collects their manifest entries.
#[derive(Clone, Debug)]
pub struct Staging {
    version: u64,
    writer: String,
    objects: Vec<ObjectEntry>,
    files: Vec<FileRef>,
}

impl Staging {
    /// Starts writing `version` with a fresh writer token.
    pub fn new(version: u64) -> Staging {
        Staging {
            version,
            writer: writer_token(),
            objects: Vec::new(),
            files: Vec::new(),
        }
    }

    /// Starts writing `version` under a given writer token (the ranks of a
    /// distributed publish share one, see [`super::parts`]).
    pub fn with_writer(version: u64, writer: String) -> Staging {
        Staging {
            version,
            writer,
            objects: Vec::new(),
            files: Vec::new(),
        }
    }

    /// The version being written.
    pub fn version(&self) -> u64 {
        self.version
    }

    /// The writer token.
    pub fn writer(&self) -> &str {
        &self.writer
    }

    /// The entries collected so far.
    pub fn objects(&self) -> &[ObjectEntry] {
        &self.objects
    }

    /// The key object `name` of `role` goes to.
    pub fn key(&self, role: ObjectRole, name: &str) -> Result<String> {
        object_key(role, self.version, &self.writer, name)
    }

    /// Uploads one object from memory and records its entry.
    pub async fn upload(
        &mut self,
        store: &Store,
        name: &str,
        role: ObjectRole,
        bytes: Bytes,
    ) -> Result<&ObjectEntry> {
        let key = self.key(role, name)?;
        let entry = ObjectEntry {
            name: name.to_string(),
            role,
            key: key.clone(),
            size: bytes.len() as u64,
            blake3: crate::digest::blake3_of(&bytes).to_hex().to_string(),
        };
        store.put(&key, bytes).await?;
        Ok(self.record(entry))
    }

    /// Uploads the file at `path` — `size` bytes with BLAKE3 `blake3`, computed
    /// when it was written — streaming it in parts, and records its entry.
    pub async fn upload_file(
        &mut self,
        store: &Store,
        name: &str,
        role: ObjectRole,
        path: &std::path::Path,
        (size, blake3): (u64, String),
    ) -> Result<&ObjectEntry> {
        let key = self.key(role, name)?;
        store.put_file(&key, path).await?;
        Ok(self.record(ObjectEntry {
            name: name.to_string(),
            role,
            key,
            size,
            blake3,
        }))
    }

    /// Records an entry for an object uploaded by other means (it must be at
    /// [`Staging::key`]).
    pub fn record(&mut self, entry: ObjectEntry) -> &ObjectEntry {
        self.objects.push(entry);
        self.objects.last().expect("just pushed")
    }

    /// Lists a non-tensor file of the version (every one, changed or not; a
    /// changed one is also uploaded as a `file` object).
    pub fn list_file(&mut self, name: &str, size: u64, blake3: String) {
        self.files.push(FileRef {
            name: name.to_string(),
            size,
            blake3,
        });
    }

    /// The manifest of this version.
    pub fn manifest(
        self,
        kind: VersionKind,
        base_version: Option<u64>,
        anchor_version: u64,
        step: Option<u64>,
    ) -> Manifest {
        Manifest {
            format: MANIFEST_FORMAT.into(),
            version: self.version,
            kind,
            base_version,
            anchor_version,
            step,
            writer: self.writer,
            objects: self.objects,
            files: self.files,
        }
    }
}

/// Makes a version visible: creates its manifest if no other writer has. Call
/// after every object of the manifest is uploaded. On stores that ignore
/// conditional writes two writers can both see `Committed` — publishers must
/// refuse such stores (see [`Store::probe_conditional_writes`]) unless the
/// operator vouches for a single writer.
///
/// A create whose answer is lost is resolved by reading the manifest back:
/// the store may have applied it and then failed (object_store retries a
/// 5xx, and the retry finds the key taken — by this very write), or the
/// client may have timed out on it (creates are not retried on timeouts).
/// The manifest's writer token, unique to this attempt, says whose it is. If
/// no manifest is there the error is returned; should the write still land
/// later, the version is a complete, valid commit of this writer's objects,
/// and a publisher that took the error as a failure resyncs past it.
pub async fn commit(store: &Store, manifest: &Manifest) -> Result<Commit> {
    manifest.validate()?;
    let body = serde_json::to_vec_pretty(manifest).expect("manifest serializes");
    let created = store
        .create(&manifest_key(manifest.version), Bytes::from(body))
        .await;
    let ours = |m: &Manifest| m.writer == manifest.writer;
    match created {
        Ok(Created::Created) => Ok(Commit::Committed),
        Ok(Created::AlreadyExists) => match read_manifest(store, manifest.version).await? {
            Some(m) if ours(&m) => Ok(Commit::Committed),
            _ => Ok(Commit::VersionTaken),
        },
        Err(e) => match read_manifest(store, manifest.version).await {
            Ok(Some(m)) if ours(&m) => Ok(Commit::Committed),
            Ok(Some(_)) => Ok(Commit::VersionTaken),
            _ => Err(e),
        },
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
    let key = manifest_key(version);
    let Some(bytes) = store.get_at_most(&key, MAX_MANIFEST_BYTES as u64).await? else {
        return Ok(None);
    };
    let m = Manifest::parse(&bytes, &key)?;
    if m.version != version {
        return Err(Error::metadata(
            format!("manifest {key}"),
            format!("holds version {}", m.version),
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

/// The newest committed version, if any.
pub async fn newest_version(store: &Store) -> Result<Option<u64>> {
    Ok(versions_after(store, None).await?.last().copied())
}

/// Rewrites `latest.json` from the committed manifests (after a crash between
/// a commit and its hint). Returns the newest version, if any.
pub async fn repair_latest(store: &Store) -> Result<Option<Latest>> {
    let Some(newest) = newest_version(store).await? else {
        return Ok(None);
    };
    let m = read_manifest(store, newest)
        .await?
        .ok_or_else(|| Error::NotFound(format!("version {newest} vanished while being read")))?;
    let latest = Latest {
        version: newest,
        anchor_version: m.anchor_version,
    };
    write_latest(store, &latest).await?;
    Ok(Some(latest))
}
