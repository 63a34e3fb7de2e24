//! The publisher: turns checkpoints into committed versions.
//!
//! Each call to [`Publisher::publish`] takes a checkpoint — one `.safetensors`
//! file, or a Hugging Face directory of shards plus
//! `model.safetensors.index.json`, config and tokenizer files — and commits it
//! as the next version: an anchor (every safetensors file in full) or a delta
//! (per safetensors file, only the changed elements), plus every non-tensor
//! file that is new or changed.
//!
//! The publisher's snapshot is the last *committed* state, kept in memory and
//! persisted under the state directory (as anchor-format files carrying their
//! digests, plus `state.json`) only after the commit succeeded. A restarted
//! publisher reloads it, re-verifies its digests, and checks the bucket: if the
//! bucket moved past the snapshot (another writer, or a crash between commit and
//! snapshot write), or the snapshot does not verify, it publishes a fresh
//! anchor instead of a delta.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use crate::codec::{DeltaOptions, encode_delta, read_anchor};
use crate::error::{Error, Result};
use crate::format::Encoding;
use crate::protocol::{
    Commit, Latest, MANIFEST_FORMAT, Manifest, ObjectEntry, ObjectRole, VersionKind, commit,
    is_safe_file_name, upload_bridge, upload_file, upload_object, versions_after, write_latest,
    writer_token,
};
use crate::store::{ConditionalWrites, Store};
use crate::tensors::{Digests, TensorSet};

/// When to write an anchor instead of a delta.
#[derive(Clone, Debug)]
pub struct AnchorPolicy {
    /// An anchor at least every this many versions.
    pub every: u64,
    /// An anchor when the deltas since the last anchor, plus this one, would
    /// exceed this fraction of an anchor's size (what a newcomer replays).
    pub max_replay_fraction: f64,
    /// An anchor when a delta would exceed this fraction of the anchor's size
    /// (e.g. after re-quantization nearly everything changed).
    pub max_delta_fraction: f64,
}

impl Default for AnchorPolicy {
    fn default() -> Self {
        AnchorPolicy {
            every: 10,
            max_replay_fraction: 0.5,
            max_delta_fraction: 0.3,
        }
    }
}

/// Publisher settings.
#[derive(Clone, Debug)]
pub struct PublisherConfig {
    /// Where the snapshot and `state.json` live.
    pub state_dir: PathBuf,
    /// Delta encoding.
    pub encoding: Encoding,
    /// Anchor policy.
    pub anchors: AnchorPolicy,
    /// Publish even if the store ignores conditional writes (the operator
    /// guarantees a single writer per prefix).
    pub single_writer: bool,
    /// Subscribers to notify besides those registered in the bucket.
    pub notify_urls: Vec<String>,
    /// The notify secret; without it no notification is sent.
    pub notify_key: Option<crate::notify::Key>,
    /// Automatic retention, run after each anchor commit (`None`: keep
    /// everything; `weightcast gc` can still collect).
    pub retention: Option<crate::protocol::Retention>,
}

/// What one publish did (the CLI prints it as one JSON line).
#[derive(Clone, Debug, Serialize)]
pub struct Published {
    /// The committed version.
    pub version: u64,
    /// `anchor` or `delta`.
    pub kind: VersionKind,
    /// Bytes written to the bucket for this version (objects and manifest).
    pub bytes: u64,
    /// Changed elements (anchors: all).
    pub changed: u64,
    /// Elements of the checkpoint.
    pub total: u64,
    /// Why an anchor was written, when it was.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub anchor_reason: Option<String>,
    /// Bytes of an anchor's bridge deltas (included in `bytes`).
    #[serde(skip_serializing_if = "is_zero")]
    pub bridge_bytes: u64,
    /// Subscribers notified successfully.
    pub notified: usize,
    /// What automatic retention removed after this version, when it ran.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub collected: Option<crate::protocol::Collected>,
}

fn is_zero(v: &u64) -> bool {
    *v == 0
}

/// Persisted publisher state (`state.json`).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
struct State {
    version: u64,
    anchor_version: u64,
    anchor_bytes: u64,
    bytes_since_anchor: u64,
    /// Non-tensor files of the snapshot: name → BLAKE3.
    files: BTreeMap<String, String>,
    /// Safetensors files of the snapshot: name → file digest.
    tensor_files: BTreeMap<String, String>,
}

/// A checkpoint as read from disk.
struct Checkpoint {
    /// Safetensors files by name.
    tensors: BTreeMap<String, TensorSet>,
    /// Other files by name.
    files: BTreeMap<String, Bytes>,
}

fn read_checkpoint(path: &Path) -> Result<Checkpoint> {
    let mut cp = Checkpoint {
        tensors: BTreeMap::new(),
        files: BTreeMap::new(),
    };
    let meta =
        std::fs::metadata(path).map_err(|e| Error::io(format!("reading {}", path.display()), e))?;
    let entries: Vec<(String, PathBuf)> = if meta.is_dir() {
        let mut v = Vec::new();
        for e in std::fs::read_dir(path)
            .map_err(|e| Error::io(format!("listing {}", path.display()), e))?
        {
            let e = e.map_err(|e| Error::io(format!("listing {}", path.display()), e))?;
            let ft = e
                .file_type()
                .map_err(|err| Error::io(format!("reading {}", e.path().display()), err))?;
            if ft.is_file()
                && let Some(name) = e.file_name().to_str()
            {
                v.push((name.to_string(), e.path()));
            }
        }
        v
    } else {
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .ok_or_else(|| Error::Config(format!("{}: not a file name", path.display())))?;
        vec![(name.to_string(), path.to_path_buf())]
    };
    for (name, p) in entries {
        if !is_safe_file_name(&name) || name.starts_with('.') {
            continue;
        }
        if name.ends_with(".safetensors") {
            cp.tensors.insert(name, TensorSet::read(&p, Digests::Skip)?);
        } else {
            let bytes =
                std::fs::read(&p).map_err(|e| Error::io(format!("reading {}", p.display()), e))?;
            cp.files.insert(name, Bytes::from(bytes));
        }
    }
    if cp.tensors.is_empty() {
        return Err(Error::Config(format!(
            "{}: no .safetensors file",
            path.display()
        )));
    }
    Ok(cp)
}

/// Publishes checkpoints to one store prefix.
pub struct Publisher {
    store: Store,
    cfg: PublisherConfig,
    state: Option<State>,
    snapshot: BTreeMap<String, TensorSet>,
}

impl Publisher {
    /// Opens a publisher: probes the store's conditional writes (refusing a
    /// store that ignores them unless `single_writer`), loads and verifies the
    /// snapshot, and reconciles it with the bucket.
    pub async fn open(store: Store, cfg: PublisherConfig) -> Result<Publisher> {
        if store.probe_conditional_writes().await? == ConditionalWrites::Ignored
            && !cfg.single_writer
        {
            return Err(Error::Config(format!(
                "store `{}` accepts conditional writes but does not enforce them (a second \
                 create-if-absent overwrote the first), so two publishers could both commit the \
                 same version. Use a store that enforces them (AWS S3, MinIO, R2, GCS, Azure), or \
                 pass --single-writer if exactly one publisher ever writes this prefix.",
                store.url()
            )));
        }
        let mut p = Publisher {
            store,
            cfg,
            state: None,
            snapshot: BTreeMap::new(),
        };
        p.load_snapshot().await;
        Ok(p)
    }

    fn state_path(&self) -> PathBuf {
        self.cfg.state_dir.join("state.json")
    }

    fn snapshot_dir(&self) -> PathBuf {
        self.cfg.state_dir.join("snapshot")
    }

    /// Loads the persisted snapshot; any doubt (missing, unreadable, digests
    /// wrong, bucket ahead of it) leaves no snapshot, so the next publish is an
    /// anchor.
    async fn load_snapshot(&mut self) {
        let Ok(bytes) = std::fs::read(self.state_path()) else {
            return;
        };
        let Ok(state) = serde_json::from_slice::<State>(&bytes) else {
            tracing::warn!("publisher state unreadable; the next version will be an anchor");
            return;
        };
        let mut snapshot = BTreeMap::new();
        for (name, digest) in &state.tensor_files {
            let path = self.snapshot_dir().join(name);
            let loaded = std::fs::read(&path)
                .map_err(|e| Error::io(path.display().to_string(), e))
                .and_then(read_anchor);
            match loaded {
                Ok((_, set)) if set.digest().to_string() == *digest => {
                    snapshot.insert(name.clone(), set);
                }
                _ => {
                    tracing::warn!(file = %name, "snapshot file missing or corrupt; the next version will be an anchor");
                    return;
                }
            }
        }
        match versions_after(&self.store, Some(state.version)).await {
            Ok(newer) if newer.is_empty() => {
                self.state = Some(state);
                self.snapshot = snapshot;
            }
            Ok(newer) => {
                tracing::warn!(
                    snapshot = state.version,
                    bucket = newer.last().copied().unwrap_or_default(),
                    "the bucket is ahead of the snapshot; the next version will be an anchor"
                );
                // Keep numbering after the bucket's newest version.
                self.state = Some(State {
                    version: *newer.last().expect("non-empty"),
                    ..State::default()
                });
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot list versions; the next version will be an anchor")
            }
        }
    }

    /// The last committed version, if any.
    pub fn version(&self) -> Option<u64> {
        self.state.as_ref().map(|s| s.version)
    }

    /// Publishes the checkpoint at `path` as the next version.
    pub async fn publish(&mut self, path: &Path) -> Result<Published> {
        let mut cp = read_checkpoint(path)?;
        let next = match &self.state {
            Some(s) => s.version + 1,
            None => match versions_after(&self.store, None).await?.last() {
                Some(&v) => v + 1,
                None => 0,
            },
        };
        let mut anchor_reason = self.anchor_reason(&cp, next);
        let total: u64 = cp.tensors.values().map(|t| t.total_elements()).sum();

        // Deltas against the snapshot whenever the files are the same: they are
        // this version's delta, or the bridges of an anchor. Every one is
        // encoded before anything is uploaded, so a tensor whose structure
        // changed turns the version into an anchor without bridges.
        let mut deltas: Vec<(String, Vec<u8>)> = Vec::new();
        let mut changed = 0u64;
        if self.diffable(&cp) {
            let mut structure = None;
            for (name, set) in cp.tensors.iter_mut() {
                let opts = DeltaOptions {
                    encoding: self.cfg.encoding,
                    model_version: next,
                    base_version: next - 1,
                    trl: Default::default(),
                };
                match encode_delta(&self.snapshot[name], set, &opts) {
                    Ok((d, s)) => {
                        changed += s.changed;
                        deltas.push((name.clone(), d));
                    }
                    Err(Error::StructureChanged(why)) => {
                        structure = Some(format!("{name}: {why}"));
                        break;
                    }
                    Err(e) => return Err(e),
                }
            }
            let st = self.state.as_ref().expect("diffable implies a state");
            let anchor = st.anchor_bytes.max(1) as f64;
            let delta_bytes: u64 = deltas.iter().map(|d| d.1.len() as u64).sum();
            if let Some(why) = structure {
                deltas.clear();
                anchor_reason = Some(why);
            } else if delta_bytes as f64 > self.cfg.anchors.max_delta_fraction * anchor {
                // Nearly the model: not worth keeping even as a bridge.
                deltas.clear();
                anchor_reason = Some(format!(
                    "delta would be {:.0}% of an anchor",
                    100.0 * delta_bytes as f64 / anchor
                ));
            } else if anchor_reason.is_none()
                && (st.bytes_since_anchor + delta_bytes) as f64
                    > self.cfg.anchors.max_replay_fraction * anchor
            {
                anchor_reason =
                    Some("a newcomer's replay since the last anchor would exceed the limit".into());
            }
        }
        if let Some(reason) = anchor_reason {
            return self.publish_anchor(cp, next, reason, deltas).await;
        }

        let writer = writer_token();
        let mut objects: Vec<ObjectEntry> = Vec::new();
        let mut bytes = 0u64;
        for (name, d) in deltas {
            bytes += d.len() as u64;
            objects.push(
                upload_object(
                    &self.store,
                    next,
                    &writer,
                    &name,
                    ObjectRole::Delta,
                    Bytes::from(d),
                )
                .await?,
            );
        }
        let st = self.state.clone().expect("delta implies a state");
        bytes += self
            .upload_changed_files(&cp, next, &writer, &st.files, &mut objects)
            .await?;
        let manifest = Manifest {
            format: MANIFEST_FORMAT.into(),
            version: next,
            kind: VersionKind::Delta,
            base_version: Some(next - 1),
            anchor_version: st.anchor_version,
            writer,
            objects,
        };
        bytes += self.commit(&manifest).await?;
        let new_state = State {
            version: next,
            anchor_version: st.anchor_version,
            anchor_bytes: st.anchor_bytes,
            bytes_since_anchor: st.bytes_since_anchor + bytes,
            files: file_hashes(&cp),
            tensor_files: tensor_digests(&cp),
        };
        self.persist(cp.tensors, new_state)?;
        let notified = self.notify(next, st.anchor_version).await;
        Ok(Published {
            version: next,
            kind: VersionKind::Delta,
            bytes,
            changed,
            total,
            anchor_reason: None,
            bridge_bytes: 0,
            notified,
            collected: None,
        })
    }

    /// Whether the checkpoint can be diffed against the snapshot: there is a
    /// trusted one and it has the same safetensors files.
    fn diffable(&self, cp: &Checkpoint) -> bool {
        self.state.is_some()
            && !self.snapshot.is_empty()
            && cp.tensors.len() == self.snapshot.len()
            && cp.tensors.keys().all(|k| self.snapshot.contains_key(k))
    }

    fn anchor_reason(&self, cp: &Checkpoint, next: u64) -> Option<String> {
        let Some(st) = &self.state else {
            return Some(
                "no trusted snapshot (first version, or the snapshot could not be verified)".into(),
            );
        };
        if self.snapshot.is_empty() {
            return Some("no trusted snapshot".into());
        }
        if next - st.anchor_version >= self.cfg.anchors.every {
            return Some(format!("every {} versions", self.cfg.anchors.every));
        }
        let same_files = cp.tensors.len() == self.snapshot.len()
            && cp.tensors.keys().all(|k| self.snapshot.contains_key(k));
        if !same_files {
            return Some("the set of safetensors files changed".into());
        }
        None
    }

    /// Publishes an anchor; `bridges` (deltas from the previous version, one per
    /// safetensors file, or none) go into the same version so that subscribers
    /// behind it can replay across it.
    async fn publish_anchor(
        &mut self,
        mut cp: Checkpoint,
        next: u64,
        reason: String,
        bridges: Vec<(String, Vec<u8>)>,
    ) -> Result<Published> {
        let writer = writer_token();
        let mut objects = Vec::new();
        let mut bytes = 0u64;
        let total: u64 = cp.tensors.values().map(|t| t.total_elements()).sum();
        for set in cp.tensors.values_mut() {
            if !set.has_digests() {
                set.compute_digests();
            }
        }
        // The anchor objects are the new snapshot's files: write them once,
        // into the staging directory, and upload them from there in parts — no
        // in-memory copy of the model. They become the snapshot after the commit.
        for (name, staged) in self.stage(&cp.tensors, next)? {
            bytes += staged.size;
            objects.push(
                upload_file(
                    &self.store,
                    next,
                    &writer,
                    &name,
                    ObjectRole::Anchor,
                    &staged.path,
                    staged.size,
                    staged.blake3,
                )
                .await?,
            );
        }
        let anchor_bytes = bytes;
        let bridged = !bridges.is_empty();
        let mut bridge_bytes = 0u64;
        for (name, d) in bridges {
            bridge_bytes += d.len() as u64;
            objects.push(upload_bridge(&self.store, next, &writer, &name, Bytes::from(d)).await?);
        }
        bytes += bridge_bytes;
        bytes += self
            .upload_changed_files(&cp, next, &writer, &BTreeMap::new(), &mut objects)
            .await?;
        let manifest = Manifest {
            format: MANIFEST_FORMAT.into(),
            version: next,
            kind: VersionKind::Anchor,
            base_version: bridged.then(|| next - 1),
            anchor_version: next,
            writer,
            objects,
        };
        bytes += self.commit(&manifest).await?;
        let new_state = State {
            version: next,
            anchor_version: next,
            anchor_bytes,
            bytes_since_anchor: 0,
            files: file_hashes(&cp),
            tensor_files: tensor_digests(&cp),
        };
        // The staged files are this version's anchors: they become the snapshot.
        self.install(cp.tensors, new_state)?;
        let notified = self.notify(next, next).await;
        let collected = self.collect().await;
        Ok(Published {
            version: next,
            kind: VersionKind::Anchor,
            bytes,
            changed: total,
            total,
            anchor_reason: Some(reason),
            bridge_bytes,
            notified,
            collected,
        })
    }

    /// Automatic retention after an anchor; never fails the publish.
    async fn collect(&self) -> Option<crate::protocol::Collected> {
        let retention = self.cfg.retention.as_ref()?;
        match crate::protocol::collect_garbage(&self.store, retention, false).await {
            Ok(c) => {
                tracing::info!(
                    keep_from = ?c.keep_from,
                    versions = c.versions.len(),
                    objects = c.objects,
                    bytes = c.bytes,
                    "retention"
                );
                Some(c)
            }
            Err(e) => {
                tracing::warn!(error = %e, "automatic retention failed; the publish stands");
                None
            }
        }
    }

    /// Notifies the static and registered subscribers; never fails the publish.
    async fn notify(&self, version: u64, anchor_version: u64) -> usize {
        let Some(key) = &self.cfg.notify_key else {
            return 0;
        };
        let mut urls = self.cfg.notify_urls.clone();
        // A registration not refreshed within the retention's horizon (a day by
        // default) belongs to a subscriber that went away: not worth a POST.
        let max_age = self
            .cfg
            .retention
            .as_ref()
            .and_then(|r| r.registration_max_age_s)
            .unwrap_or(
                crate::protocol::Retention::default()
                    .registration_max_age_s
                    .unwrap_or(u64::MAX),
            );
        let now = crate::notify::unix_now();
        match crate::notify::registrations(&self.store).await {
            Ok(regs) => urls.extend(
                regs.into_iter()
                    .filter(|r| now.saturating_sub(r.updated_at) <= max_age)
                    .filter_map(|r| r.notify_url),
            ),
            Err(e) => tracing::warn!(error = %e, "cannot list subscriber registrations"),
        }
        urls.sort();
        urls.dedup();
        let n = crate::notify::Notification {
            store: self.store.url().to_string(),
            version,
            anchor_version,
        };
        crate::notify::send(&urls, key, &n)
            .await
            .iter()
            .filter(|d| d.ok)
            .count()
    }

    /// Uploads the non-tensor files that differ from `previous` (name → BLAKE3).
    async fn upload_changed_files(
        &self,
        cp: &Checkpoint,
        version: u64,
        writer: &str,
        previous: &BTreeMap<String, String>,
        objects: &mut Vec<ObjectEntry>,
    ) -> Result<u64> {
        let mut bytes = 0;
        for (name, body) in &cp.files {
            let hash = blake3::hash(body).to_hex().to_string();
            if previous.get(name) == Some(&hash) {
                continue;
            }
            bytes += body.len() as u64;
            objects.push(
                upload_object(
                    &self.store,
                    version,
                    writer,
                    name,
                    ObjectRole::File,
                    body.clone(),
                )
                .await?,
            );
        }
        Ok(bytes)
    }

    /// Commits a manifest and updates the hint; returns the manifest's size.
    async fn commit(&self, manifest: &Manifest) -> Result<u64> {
        match commit(&self.store, manifest).await? {
            Commit::Committed => {}
            Commit::VersionTaken => {
                return Err(Error::Config(format!(
                    "version {} was committed by another publisher; this publisher's objects are \
                     not visible. Restart it to continue after the bucket's newest version.",
                    manifest.version
                )));
            }
        }
        write_latest(
            &self.store,
            &Latest {
                version: manifest.version,
                anchor_version: manifest.anchor_version,
            },
        )
        .await?;
        Ok(serde_json::to_vec_pretty(manifest)
            .map(|v| v.len() as u64)
            .unwrap_or(0))
    }

    /// Makes the committed checkpoint the snapshot, in memory and on disk:
    /// files go to a fresh directory that replaces the old one, then
    /// `state.json` is replaced; a crash in between is caught on reload by the
    /// digest check or the bucket-ahead check.
    fn persist(&mut self, tensors: BTreeMap<String, TensorSet>, state: State) -> Result<()> {
        self.stage(&tensors, state.version)?;
        self.install(tensors, state)
    }

    fn staging_dir(&self) -> PathBuf {
        self.cfg.state_dir.join("snapshot.tmp")
    }

    /// Writes `tensors` as anchor-format files of `version` into the staging
    /// directory, hashing them as they are written.
    fn stage(
        &self,
        tensors: &BTreeMap<String, TensorSet>,
        version: u64,
    ) -> Result<BTreeMap<String, Staged>> {
        let tmp = self.staging_dir();
        let io = |what: &str, p: &Path, e| Error::io(format!("{what} {}", p.display()), e);
        let _ = std::fs::remove_dir_all(&tmp);
        std::fs::create_dir_all(&tmp).map_err(|e| io("creating", &tmp, e))?;
        let mut out = BTreeMap::new();
        for (name, set) in tensors {
            let path = tmp.join(name);
            let file = std::fs::File::create(&path).map_err(|e| io("creating", &path, e))?;
            let mut w = HashingWriter {
                inner: std::io::BufWriter::with_capacity(1 << 20, file),
                hasher: blake3::Hasher::new(),
                size: 0,
            };
            crate::codec::write_anchor(set, version, &mut w)?;
            use std::io::Write;
            w.inner.flush().map_err(|e| io("writing", &path, e))?;
            out.insert(
                name.clone(),
                Staged {
                    path,
                    size: w.size,
                    blake3: w.hasher.finalize().to_hex().to_string(),
                },
            );
        }
        Ok(out)
    }

    /// Makes the staged files the snapshot and records `state`.
    fn install(&mut self, tensors: BTreeMap<String, TensorSet>, state: State) -> Result<()> {
        let dir = self.snapshot_dir();
        let tmp = self.staging_dir();
        let io = |what: &str, p: &Path, e| Error::io(format!("{what} {}", p.display()), e);
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::rename(&tmp, &dir).map_err(|e| io("renaming", &tmp, e))?;
        let sp = self.state_path();
        let st_tmp = sp.with_extension("json.tmp");
        std::fs::write(
            &st_tmp,
            serde_json::to_vec_pretty(&state).expect("state serializes"),
        )
        .map_err(|e| io("writing", &st_tmp, e))?;
        std::fs::rename(&st_tmp, &sp).map_err(|e| io("renaming", &st_tmp, e))?;
        self.snapshot = tensors;
        self.state = Some(state);
        Ok(())
    }
}

/// A snapshot file written to the staging directory.
struct Staged {
    path: PathBuf,
    size: u64,
    blake3: String,
}

/// Counts and hashes what passes through to `inner`.
struct HashingWriter<W> {
    inner: W,
    hasher: blake3::Hasher,
    size: u64,
}

impl<W: std::io::Write> std::io::Write for HashingWriter<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hasher.update(&buf[..n]);
        self.size += n as u64;
        Ok(n)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

fn tensor_digests(cp: &Checkpoint) -> BTreeMap<String, String> {
    cp.tensors
        .iter()
        .map(|(n, t)| (n.clone(), t.digest().to_string()))
        .collect()
}

fn file_hashes(cp: &Checkpoint) -> BTreeMap<String, String> {
    cp.files
        .iter()
        .map(|(n, b)| (n.clone(), blake3::hash(b).to_hex().to_string()))
        .collect()
}
