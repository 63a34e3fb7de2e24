//! The subscriber: catches up to the newest committed version, verifies it,
//! and materializes it as a loadable checkpoint directory.
//!
//! Output layout (`DIR` = `--out`):
//!
//! ```text
//! DIR/current -> versions/<version:020>     symlink, switched atomically per version
//! DIR/versions/<version:020>/<files>        the checkpoint's own file names
//! DIR/.state.json                           the verified version and its digests
//! ```
//!
//! A reader that opens `DIR/current/...` sees one whole version: the next one is
//! fully written and verified in its own directory before the symlink is
//! replaced (a `rename`, atomic on POSIX). The previous version's directory is
//! removed afterwards.
//!
//! Catching up from version `a` to `b`: replay the deltas after `a` when they
//! add up to less than the newest anchor at or before `b`, otherwise start from
//! that anchor. Every object's size and BLAKE3 are checked against the manifest,
//! every anchor's digests against its header, every delta against the exact
//! base it was made from. Any failure while replaying from the local state is
//! repaired by starting again from the anchor; a failure there is an error, and
//! nothing unverified is ever materialized.

pub mod status;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::codec::{anchor_prefix, apply_delta, read_anchor, write_anchor};
use crate::error::{Error, Result};
use crate::protocol::{
    Manifest, ObjectEntry, ObjectRole, is_safe_file_name, read_manifest, versions_after,
};
use crate::store::Store;
use crate::tensors::TensorSet;

/// What a catch-up did.
#[derive(Clone, Debug, Serialize)]
pub struct CaughtUp {
    /// The version now materialized.
    pub version: u64,
    /// The version before (absent on a first run).
    pub previous: Option<u64>,
    /// Bytes downloaded.
    pub downloaded: u64,
    /// Versions applied as deltas.
    pub deltas_applied: u64,
    /// Whether it started from an anchor.
    pub from_anchor: bool,
    /// Repairs: replays that failed verification and were redone from an anchor.
    pub repairs: u64,
    /// Tensors changed by the deltas applied since the last anchor load, sorted
    /// (empty when an anchor was loaded: everything may have changed).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub changed_tensors: Vec<String>,
    /// Bytes written into the new version's directory: files written in full,
    /// and the headers and changed tensors of files patched in place.
    pub written_bytes: u64,
    /// Bytes of the new version taken from the previous one without writing
    /// them: hard-linked files, and the unchanged parts of cloned files.
    pub reused_bytes: u64,
    /// Of the cloned files, the bytes the kernel copied because the filesystem
    /// cannot share extents (no reflink, e.g. ext4): no user-space I/O, but
    /// disk writes. Zero on btrfs and XFS.
    pub copied_bytes: u64,
}

impl CaughtUp {
    /// Nothing new: the output stays at `version`.
    fn unchanged(version: u64) -> CaughtUp {
        CaughtUp {
            version,
            previous: Some(version),
            downloaded: 0,
            deltas_applied: 0,
            from_anchor: false,
            repairs: 0,
            changed_tensors: Vec::new(),
            written_bytes: 0,
            reused_bytes: 0,
            copied_bytes: 0,
        }
    }
}

/// `DIR/.state.json`: the materialized version, where it is, and the digests
/// its files are checked and reused by. Fields after `digests` are absent in
/// states written by older releases (then nothing is reused the first time).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
struct LocalState {
    version: u64,
    /// Digest of each safetensors file of the materialized version.
    digests: BTreeMap<String, String>,
    /// Its directory under `versions/` (default `<version:020>`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    dir: Option<String>,
    /// Byte layout and per-tensor digests of each safetensors file.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    layouts: BTreeMap<String, FileLayout>,
    /// BLAKE3 of each other file.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    files: Option<BTreeMap<String, String>>,
}

/// Where a safetensors file keeps each tensor, and its digest.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct FileLayout {
    /// File size.
    size: u64,
    /// Offset of the tensor data (8 + header length).
    data_start: u64,
    /// Tensor name → its bytes in the file and its digest.
    tensors: BTreeMap<String, TensorSlot>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct TensorSlot {
    digest: String,
    start: u64,
    end: u64,
}

impl FileLayout {
    /// The layout of a file of `size` bytes that `set` was read from whole.
    fn on_disk(set: &TensorSet, size: u64) -> FileLayout {
        FileLayout {
            size,
            data_start: size.saturating_sub(set.total_bytes()),
            tensors: set
                .tensors()
                .iter()
                .map(|t| {
                    let slot = TensorSlot {
                        digest: t.digest.to_string(),
                        start: t.range.start as u64,
                        end: t.range.end as u64,
                    };
                    (t.name.clone(), slot)
                })
                .collect(),
        }
    }

    /// The layout [`write_anchor`] gives `set` after a prefix of `prefix` bytes.
    fn written(set: &TensorSet, prefix: u64) -> FileLayout {
        let mut at = prefix;
        let tensors = set
            .tensors()
            .iter()
            .map(|t| {
                let start = at;
                at += t.range.len() as u64;
                let slot = TensorSlot {
                    digest: t.digest.to_string(),
                    start,
                    end: at,
                };
                (t.name.clone(), slot)
            })
            .collect();
        FileLayout {
            size: at,
            data_start: prefix,
            tensors,
        }
    }
}

/// A verified in-memory state of one version.
struct Replica {
    version: u64,
    tensors: BTreeMap<String, TensorSet>,
    files: BTreeMap<String, Vec<u8>>,
    /// Tensors changed by deltas since the last anchor this replica loaded.
    changed: std::collections::BTreeSet<String>,
}

/// Catches `out` up to the newest committed version of `store`. Returns `None`
/// when the bucket has no version yet.
pub async fn catch_up(store: &Store, out: &Path) -> Result<Option<CaughtUp>> {
    // The cheap poll: nothing after the recorded version (one listing that
    // starts after it), and that version still committed (one small read).
    // The materialized files are re-verified only when there is something to
    // apply to them, so an idle poll costs two requests, not a pass over the
    // model.
    let recorded = read_state(out).filter(|_| out.join("current").exists());
    if let Some(state) = &recorded
        && versions_after(store, Some(state.version)).await?.is_empty()
        && read_manifest(store, state.version).await?.is_some()
    {
        return Ok(Some(CaughtUp::unchanged(state.version)));
    }
    let Some(&newest) = versions_after(store, None).await?.last() else {
        return Ok(None);
    };
    let local = load_local(out);
    if let Some((state, _)) = &local
        && state.version == newest
    {
        return Ok(Some(CaughtUp::unchanged(newest)));
    }
    let target = read_manifest(store, newest)
        .await?
        .ok_or_else(|| Error::metadata("manifest", format!("version {newest} vanished")))?;
    let mut downloaded = 0u64;
    let mut repairs = 0u64;
    let previous = local.as_ref().map(|(s, _)| s.version);
    let prev_state = local.as_ref().map(|(s, _)| s.clone());

    // Replay from the local state when the deltas are cheaper than the anchor
    // (across anchors too, through their bridge deltas).
    let mut result: Option<(Replica, u64)> = None;
    if let Some((state, replica)) = local
        && state.version < newest
        && replay_is_cheaper(store, state.version, &target).await
    {
        match replay_from(store, replica, newest).await {
            Ok((r, bytes, applied)) => {
                downloaded += bytes;
                result = Some((r, applied));
            }
            Err(e) => {
                tracing::warn!(error = %e, "replay from the local state failed; repairing from the anchor");
                repairs += 1;
            }
        }
    }
    let from_anchor = result.is_none();
    let (replica, applied) = match result {
        Some(r) => r,
        None => {
            let (r, bytes, applied) = bootstrap(store, target.anchor_version, newest).await?;
            downloaded += bytes;
            (r, applied)
        }
    };
    let io = materialize(out, &replica, prev_state.as_ref())?;
    Ok(Some(CaughtUp {
        version: replica.version,
        previous,
        downloaded,
        deltas_applied: applied,
        from_anchor,
        repairs,
        changed_tensors: if from_anchor {
            Vec::new()
        } else {
            replica.changed.into_iter().collect()
        },
        written_bytes: io.written,
        reused_bytes: io.reused,
        copied_bytes: io.copied,
    }))
}

/// Downloads an object and checks it against its manifest entry.
async fn fetch(store: &Store, o: &ObjectEntry) -> Result<Vec<u8>> {
    // The manifest's size bounds the read: an object that grew is refused from
    // its reported size, before its body is buffered.
    let body = store
        .get_at_most(&o.key, o.size)
        .await?
        .ok_or_else(|| Error::metadata("manifest", format!("object `{}` is missing", o.key)))?;
    if body.len() as u64 != o.size || blake3::hash(&body).to_hex().as_str() != o.blake3 {
        return Err(Error::Integrity {
            scope: format!("object {}", o.key),
            expected: o.blake3.clone(),
            actual: blake3::hash(&body).to_hex().to_string(),
        });
    }
    Ok(body.to_vec())
}

/// Applies one manifest's objects to `r`.
async fn apply_manifest<'a>(
    store: &Store,
    r: &mut Replica,
    m: &'a Manifest,
    objects: impl Iterator<Item = &'a ObjectEntry>,
) -> Result<u64> {
    let mut bytes = 0;
    for o in objects {
        let body = fetch(store, o).await?;
        bytes += body.len() as u64;
        match o.role {
            ObjectRole::Anchor => {
                let (header, set) = read_anchor(body)?;
                if header.is_none() {
                    return Err(Error::metadata(
                        "anchor",
                        format!("`{}` has no weightcast header", o.key),
                    ));
                }
                r.tensors.insert(o.name.clone(), set);
                r.changed.clear();
            }
            ObjectRole::Delta => {
                let set = r.tensors.get_mut(&o.name).ok_or_else(|| {
                    Error::metadata(
                        "manifest",
                        format!("delta for `{}`, which the base does not have", o.name),
                    )
                })?;
                let report = apply_delta(set, &body)?;
                if !report.verified || report.model_version != Some(m.version) {
                    return Err(Error::metadata(
                        "delta",
                        format!(
                            "`{}` is not a verified delta to version {}",
                            o.key, m.version
                        ),
                    ));
                }
                r.changed.extend(report.changed_tensors);
            }
            ObjectRole::File => {
                r.files.insert(o.name.clone(), body);
            }
        }
    }
    r.version = m.version;
    Ok(bytes)
}

/// Longest replay considered before jumping to the anchor regardless.
const MAX_REPLAY_VERSIONS: u64 = 1000;

/// Whether a replica at `held` reaches `target` more cheaply by replaying
/// every version after it than by starting from `target`'s anchor. Reads the
/// manifests in between (small objects); any doubt means no.
async fn replay_is_cheaper(store: &Store, held: u64, target: &Manifest) -> bool {
    if held >= target.anchor_version {
        // Only deltas lie between; the publisher bounds them below an anchor.
        return true;
    }
    if target.version - held > MAX_REPLAY_VERSIONS {
        return false;
    }
    let (mut replay, mut bootstrap) = (0u64, 0u64);
    for v in held + 1..=target.version {
        let m = match read_manifest(store, v).await {
            Ok(Some(m)) if m.replays_from_previous() => m,
            _ => return false,
        };
        replay += m.replay_bytes();
        if v == target.anchor_version {
            bootstrap += m.bootstrap_bytes();
        } else if v > target.anchor_version {
            bootstrap += m.replay_bytes();
        }
    }
    replay < bootstrap
}

/// Starts from anchor `anchor` and replays up to `to`.
async fn bootstrap(store: &Store, anchor: u64, to: u64) -> Result<(Replica, u64, u64)> {
    let m = read_manifest(store, anchor).await?.ok_or_else(|| {
        Error::metadata("manifest", format!("anchor version {anchor} is missing"))
    })?;
    let mut r = Replica {
        version: anchor,
        tensors: BTreeMap::new(),
        files: BTreeMap::new(),
        changed: Default::default(),
    };
    let mut bytes = apply_manifest(store, &mut r, &m, m.bootstrap_objects()).await?;
    let (r, more, applied) = replay_from(store, r, to).await?;
    bytes += more;
    Ok((r, bytes, applied))
}

/// Applies the deltas after `r.version` up to `to`.
async fn replay_from(store: &Store, mut r: Replica, to: u64) -> Result<(Replica, u64, u64)> {
    let mut bytes = 0;
    let mut applied = 0;
    for v in r.version + 1..=to {
        let m = read_manifest(store, v)
            .await?
            .ok_or_else(|| Error::metadata("manifest", format!("version {v} is missing (gap)")))?;
        if m.base_version != Some(r.version) {
            return Err(Error::metadata(
                "manifest",
                format!("version {v} is not a delta on {}", r.version),
            ));
        }
        // Every safetensors file moves to the new version, or the replica
        // would keep a stale one.
        let deltas: std::collections::BTreeSet<&str> = m
            .objects
            .iter()
            .filter(|o| o.role == ObjectRole::Delta)
            .map(|o| o.name.as_str())
            .collect();
        if let Some(stale) = r.tensors.keys().find(|n| !deltas.contains(n.as_str())) {
            return Err(Error::metadata(
                "manifest",
                format!("version {v} has no delta for `{stale}`"),
            ));
        }
        bytes += apply_manifest(store, &mut r, &m, m.replay_objects()).await?;
        applied += 1;
    }
    Ok((r, bytes, applied))
}

fn state_path(out: &Path) -> PathBuf {
    out.join(".state.json")
}

fn versions_dir(out: &Path) -> PathBuf {
    out.join("versions")
}

/// Whether `name` is a version directory name this module writes:
/// `<version:020>`, or `<version:020>-<n>` when that name was taken.
fn is_version_dir_name(name: &str) -> bool {
    let (head, tail) = name.split_at(name.len().min(20));
    head.len() == 20
        && head.bytes().all(|b| b.is_ascii_digit())
        && (tail.is_empty()
            || tail.strip_prefix('-').is_some_and(|n| {
                !n.is_empty() && n.len() <= 10 && n.bytes().all(|b| b.is_ascii_digit())
            }))
}

/// Loads and verifies the materialized version; `None` if absent or doubtful.
///
/// Every file is read back and checked: tensor files against the digests in
/// their own header and in the state (file, and per tensor with its byte range
/// when the state has them), other files against their BLAKE3 in the state.
/// The returned state describes the files exactly as they are on disk, which is
/// what [`materialize`] reuses them by.
/// The recorded state, unverified (`None` if absent or unreadable).
fn read_state(out: &Path) -> Option<LocalState> {
    serde_json::from_slice(&std::fs::read(state_path(out)).ok()?).ok()
}

fn load_local(out: &Path) -> Option<(LocalState, Replica)> {
    let mut state = read_state(out)?;
    let dir_name = state
        .dir
        .clone()
        .unwrap_or_else(|| format!("{:020}", state.version));
    if !is_version_dir_name(&dir_name) {
        tracing::warn!(dir = %dir_name, "local state names an odd directory; re-bootstrapping");
        return None;
    }
    let dir = versions_dir(out).join(&dir_name);
    let mut r = Replica {
        version: state.version,
        tensors: BTreeMap::new(),
        files: BTreeMap::new(),
        changed: Default::default(),
    };
    let mut layouts = BTreeMap::new();
    let mut files = BTreeMap::new();
    for entry in std::fs::read_dir(&dir).ok()? {
        let entry = entry.ok()?;
        let name = entry.file_name().to_str()?.to_string();
        let bytes = std::fs::read(entry.path()).ok()?;
        if name.ends_with(".safetensors") {
            let size = bytes.len() as u64;
            let (_, set) = read_anchor(bytes).ok()?;
            let layout = FileLayout::on_disk(&set, size);
            let doubtful = state.digests.get(&name) != Some(&set.digest().to_string())
                || (!state.layouts.is_empty() && state.layouts.get(&name) != Some(&layout));
            if doubtful {
                tracing::warn!(file = %name, "materialized file does not verify; re-bootstrapping");
                return None;
            }
            layouts.insert(name.clone(), layout);
            r.tensors.insert(name, set);
        } else {
            let hash = blake3::hash(&bytes).to_hex().to_string();
            if let Some(known) = &state.files
                && known.get(&name) != Some(&hash)
            {
                tracing::warn!(file = %name, "materialized file does not verify; re-bootstrapping");
                return None;
            }
            files.insert(name.clone(), hash);
            r.files.insert(name, bytes);
        }
    }
    if r.tensors.len() != state.digests.len()
        || state.files.as_ref().is_some_and(|f| f.len() != files.len())
    {
        return None;
    }
    state.dir = Some(dir_name);
    state.layouts = layouts;
    state.files = Some(files);
    Some((state, r))
}

/// What one materialization wrote and reused.
#[derive(Clone, Copy, Debug, Default)]
struct Io {
    written: u64,
    reused: u64,
    copied: u64,
}

/// How a file of the new version is produced.
enum Plan<'a> {
    /// Identical to the previous version's file: hard link it.
    Link(&'a FileLayout),
    /// Same byte layout: clone the previous file, rewrite the header and the
    /// tensors at these indices (into [`TensorSet::tensors`]).
    Patch(Vec<usize>),
    /// Write it in full.
    Full,
}

fn plan<'a>(old: Option<&'a FileLayout>, new: &FileLayout, set: &TensorSet) -> Plan<'a> {
    let Some(old) = old else {
        return Plan::Full;
    };
    let same_names = old.tensors.len() == new.tensors.len()
        && new.tensors.keys().all(|n| old.tensors.contains_key(n));
    if !same_names {
        return Plan::Full;
    }
    if new
        .tensors
        .iter()
        .all(|(n, t)| old.tensors.get(n).is_some_and(|o| o.digest == t.digest))
    {
        // The same tensors: only the header's model_version may differ (and
        // its length, which does not matter to a reader).
        return Plan::Link(old);
    }
    let same_layout = old.size == new.size
        && old.data_start == new.data_start
        && new.tensors.iter().all(|(n, t)| {
            old.tensors
                .get(n)
                .is_some_and(|o| (o.start, o.end) == (t.start, t.end))
        });
    if !same_layout {
        return Plan::Full;
    }
    let changed = set
        .tensors()
        .iter()
        .enumerate()
        .filter(|(_, t)| {
            old.tensors
                .get(&t.name)
                .is_none_or(|o| o.digest != t.digest.to_string())
        })
        .map(|(i, _)| i)
        .collect();
    Plan::Patch(changed)
}

fn io_err(what: &str, p: &Path, e: std::io::Error) -> Error {
    Error::io(format!("{what} {}", p.display()), e)
}

/// Flushes a directory's entries (creations, links, renames) to stable storage.
fn sync_dir(p: &Path) -> Result<()> {
    std::fs::File::open(p)
        .and_then(|d| d.sync_all())
        .map_err(|e| io_err("syncing directory", p, e))
}

/// Writes `set` in full as an anchor-format file at `p`, durably.
fn write_full(p: &Path, set: &TensorSet, version: u64) -> Result<()> {
    use std::io::Write;
    let f = std::fs::File::create(p).map_err(|e| io_err("creating", p, e))?;
    let mut w = std::io::BufWriter::with_capacity(1 << 20, f);
    write_anchor(set, version, &mut w)?;
    w.flush().map_err(|e| io_err("writing", p, e))?;
    let f = w
        .into_inner()
        .map_err(|e| io_err("writing", p, e.into_error()))?;
    f.sync_all().map_err(|e| io_err("syncing", p, e))
}

/// Clones `from` to `to` (a reflink where the filesystem can, otherwise an
/// in-kernel copy), then overwrites the header and the `changed` tensors in
/// place, durably. Returns (bytes written, bytes the kernel copied).
fn write_patched(
    from: &Path,
    to: &Path,
    prefix: &[u8],
    layout: &FileLayout,
    set: &TensorSet,
    changed: &[usize],
) -> std::io::Result<(u64, u64)> {
    use std::os::unix::fs::FileExt;
    let copied = reflink_copy::reflink_or_copy(from, to)?.unwrap_or(0);
    let f = std::fs::OpenOptions::new().write(true).open(to)?;
    if f.metadata()?.len() != layout.size {
        return Err(std::io::Error::other("cloned file has an unexpected size"));
    }
    f.write_all_at(prefix, 0)?;
    let mut written = prefix.len() as u64;
    for &i in changed {
        let t = &set.tensors()[i];
        let slot = layout
            .tensors
            .get(&t.name)
            .ok_or_else(|| std::io::Error::other("tensor missing from the layout"))?;
        f.write_all_at(set.data(i), slot.start)?;
        written += slot.end - slot.start;
    }
    f.sync_all()?;
    Ok((written, copied))
}

/// A fresh directory name for `version` under `versions/`: `<version:020>`, or
/// with a `-<n>` suffix when that name is taken (a complete directory left by a
/// crash, which `current` may point to: it is never replaced in place).
fn fresh_dir_name(versions: &Path, version: u64) -> String {
    let base = format!("{version:020}");
    let taken = |n: &str| std::fs::symlink_metadata(versions.join(n)).is_ok();
    if !taken(&base) {
        return base;
    }
    (1u64..)
        .map(|k| format!("{base}-{k}"))
        .find(|n| !taken(n))
        .unwrap_or(base)
}

/// Writes the version into a directory of its own, switches `current` to it,
/// records the state, and removes every other version directory.
///
/// Output I/O follows what changed since `prev` (the verified previous version):
/// a file whose digests equal the previous one's is hard-linked, a tensor file
/// with the same byte layout is cloned and only its header and changed tensors
/// are rewritten, anything else is written in full. Everything is fsynced before
/// it is made visible: file data before the directory's rename, the directory
/// before `current` switches, the state before its rename.
fn materialize(out: &Path, r: &Replica, prev: Option<&LocalState>) -> Result<Io> {
    for name in r.tensors.keys().chain(r.files.keys()) {
        if !is_safe_file_name(name) || name.contains('/') {
            return Err(Error::metadata(
                "manifest",
                format!("unsafe file name `{name}`"),
            ));
        }
    }
    let versions = versions_dir(out);
    std::fs::create_dir_all(&versions).map_err(|e| io_err("creating", &versions, e))?;
    let prev_dir = prev.and_then(|p| p.dir.as_ref().map(|d| versions.join(d)));
    let name = fresh_dir_name(&versions, r.version);
    let dir = versions.join(&name);
    let tmp = versions.join(format!("{name}.partial"));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir(&tmp).map_err(|e| io_err("creating", &tmp, e))?;

    let mut io = Io::default();
    let mut state = LocalState {
        version: r.version,
        digests: BTreeMap::new(),
        dir: Some(name.clone()),
        layouts: BTreeMap::new(),
        files: Some(BTreeMap::new()),
    };
    for (file, set) in &r.tensors {
        let p = tmp.join(file);
        let prefix = anchor_prefix(set, r.version)?;
        let layout = FileLayout::written(set, prefix.len() as u64);
        let old = prev.and_then(|s| s.layouts.get(file));
        let from = prev_dir.as_ref().map(|d| d.join(file));
        let mut done = None;
        match (plan(old, &layout, set), &from) {
            (Plan::Link(old), Some(from)) => match std::fs::hard_link(from, &p) {
                Ok(()) => {
                    io.reused += old.size;
                    done = Some(old.clone());
                }
                Err(e) => tracing::debug!(file = %file, error = %e, "hard link failed; writing"),
            },
            (Plan::Patch(changed), Some(from)) => {
                match write_patched(from, &p, &prefix, &layout, set, &changed) {
                    Ok((written, copied)) => {
                        io.written += written;
                        io.reused += layout.size - written;
                        io.copied += copied;
                        done = Some(layout.clone());
                    }
                    Err(e) => tracing::debug!(file = %file, error = %e, "clone failed; writing"),
                }
            }
            _ => {}
        }
        let layout = match done {
            Some(l) => l,
            None => {
                write_full(&p, set, r.version)?;
                io.written += layout.size;
                layout
            }
        };
        state.digests.insert(file.clone(), set.digest().to_string());
        state.layouts.insert(file.clone(), layout);
    }
    for (file, body) in &r.files {
        let p = tmp.join(file);
        let hash = blake3::hash(body).to_hex().to_string();
        let same = prev.and_then(|s| s.files.as_ref()?.get(file)) == Some(&hash);
        let linked = match (&prev_dir, same) {
            (Some(d), true) => std::fs::hard_link(d.join(file), &p).is_ok(),
            _ => false,
        };
        if linked {
            io.reused += body.len() as u64;
        } else {
            let _ = std::fs::remove_file(&p);
            std::fs::File::create(&p)
                .and_then(|mut f| {
                    use std::io::Write;
                    f.write_all(body)?;
                    f.sync_all()
                })
                .map_err(|e| io_err("writing", &p, e))?;
            io.written += body.len() as u64;
        }
        if let Some(files) = state.files.as_mut() {
            files.insert(file.clone(), hash);
        }
    }
    sync_dir(&tmp)?;
    std::fs::rename(&tmp, &dir).map_err(|e| io_err("renaming", &tmp, e))?;
    sync_dir(&versions)?;

    // Atomic switch: a new symlink renamed over the old one.
    let link = out.join("current");
    let link_tmp = out.join(".current.tmp");
    let _ = std::fs::remove_file(&link_tmp);
    let target = Path::new("versions").join(&name);
    std::os::unix::fs::symlink(&target, &link_tmp).map_err(|e| io_err("linking", &link_tmp, e))?;
    std::fs::rename(&link_tmp, &link).map_err(|e| io_err("switching", &link, e))?;
    sync_dir(out)?;

    let sp = state_path(out);
    let sp_tmp = out.join(".state.json.tmp");
    let body = serde_json::to_vec_pretty(&state)
        .map_err(|e| Error::metadata("state", format!("cannot serialize: {e}")))?;
    std::fs::File::create(&sp_tmp)
        .and_then(|mut f| {
            use std::io::Write;
            f.write_all(&body)?;
            f.sync_all()
        })
        .map_err(|e| io_err("writing", &sp_tmp, e))?;
    std::fs::rename(&sp_tmp, &sp).map_err(|e| io_err("renaming", &sp_tmp, e))?;
    sync_dir(out)?;

    // Old versions go once nothing points at them (their files live on where
    // the new version links them).
    if let Ok(entries) = std::fs::read_dir(&versions) {
        for e in entries.flatten() {
            if e.file_name().to_str() != Some(name.as_str()) {
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
    }
    Ok(io)
}

/// Daemon settings.
#[derive(Clone, Debug)]
pub struct DaemonConfig {
    /// Output directory.
    pub out: PathBuf,
    /// Seconds between polls when no notification arrives.
    pub poll_interval: std::time::Duration,
    /// Registration id (registers in the bucket when set).
    pub id: Option<String>,
    /// The URL publishers should POST notifications to.
    pub notify_url: Option<String>,
    /// What runs after each new version (engine reloads, webhooks, commands).
    pub hooks: Vec<crate::hooks::Hook>,
}

/// How often a subscriber that stays at one version rewrites its registration
/// (a new version rewrites it at once). Well inside the publishers' default
/// registration horizon of a day.
pub const REGISTRATION_REFRESH: std::time::Duration = std::time::Duration::from_secs(600);

/// Catches up forever: after each attempt, waits for a notification or the
/// poll interval, whichever comes first (bursts of notifications coalesce).
/// Updates the shared status and, with an id, the bucket registration (on each
/// new version, and every [`REGISTRATION_REFRESH`]).
pub async fn run_daemon(store: &Store, cfg: &DaemonConfig, shared: &status::Shared) -> ! {
    // (version, when) of the last registration written.
    let mut registered: Option<(u64, std::time::Instant)> = None;
    loop {
        let started = std::time::Instant::now();
        match catch_up(store, &cfg.out).await {
            Ok(Some(c)) => {
                if let Ok(mut s) = shared.status.lock() {
                    let changed = s.version != Some(c.version);
                    s.version = Some(c.version);
                    s.newest = Some(s.newest.map_or(c.version, |v| v.max(c.version)));
                    s.lag = s.newest.map(|n| n.saturating_sub(c.version));
                    s.last_error = None;
                    s.bytes_downloaded += c.downloaded;
                    s.bytes_written += c.written_bytes;
                    s.bytes_reused += c.reused_bytes;
                    s.repairs += c.repairs;
                    if changed {
                        s.versions_applied += c.deltas_applied.max(1);
                        s.last_apply_seconds = started.elapsed().as_secs_f64();
                    }
                }
                if c.previous != Some(c.version) {
                    tracing::info!(
                        version = c.version,
                        downloaded = c.downloaded,
                        from_anchor = c.from_anchor,
                        written_bytes = c.written_bytes,
                        reused_bytes = c.reused_bytes,
                        "caught up"
                    );
                    let event = crate::hooks::Event {
                        version: c.version,
                        dir: cfg.out.join("current"),
                        changed_tensors: c.changed_tensors.clone(),
                    };
                    let report = crate::hooks::run(&cfg.hooks, &event).await;
                    if let Ok(mut s) = shared.status.lock() {
                        s.last_pause_seconds = report.pause_seconds;
                        s.hook_failures += report.failed as u64;
                    }
                }
                let due = registered
                    .is_none_or(|(v, at)| v != c.version || at.elapsed() >= REGISTRATION_REFRESH);
                if let (Some(id), true) = (&cfg.id, due) {
                    let reg = crate::protocol::Registration {
                        id: id.clone(),
                        notify_url: cfg.notify_url.clone(),
                        version: Some(c.version),
                        updated_at: crate::notify::unix_now(),
                    };
                    match crate::protocol::register(store, &reg).await {
                        Ok(()) => registered = Some((c.version, std::time::Instant::now())),
                        Err(e) => tracing::warn!(error = %e, "registration failed"),
                    }
                }
            }
            Ok(None) => {}
            Err(e) => {
                tracing::error!(error = %e, "catch-up failed; keeping the current version");
                if let Ok(mut s) = shared.status.lock() {
                    s.failures += 1;
                    s.last_error = Some(e.to_string());
                }
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(cfg.poll_interval) => {}
            _ = shared.wake.notified() => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::Dtype;

    fn set(items: &[(&str, u8, usize)]) -> TensorSet {
        TensorSet::from_tensors(
            items
                .iter()
                .map(|&(n, fill, len)| (n.to_string(), Dtype::U8, vec![len], vec![fill; len])),
        )
        .unwrap()
    }

    fn replica(version: u64, tensors: TensorSet, config: &[u8]) -> Replica {
        Replica {
            version,
            tensors: [("model.safetensors".to_string(), tensors)].into(),
            files: [("config.json".to_string(), config.to_vec())].into(),
            changed: Default::default(),
        }
    }

    fn file(out: &Path, name: &str) -> Vec<u8> {
        std::fs::read(out.join("current").join(name)).unwrap()
    }

    #[test]
    fn version_directory_names() {
        let v = format!("{:020}", 7);
        assert!(is_version_dir_name(&v));
        assert!(is_version_dir_name(&format!("{v}-3")));
        for bad in [
            "7".to_string(),
            format!("{v}0"),
            format!("{v}-"),
            format!("{v}-x"),
            format!("{v}.partial"),
            "../../etc".to_string(),
            format!("{v}/.."),
        ] {
            assert!(!is_version_dir_name(&bad), "{bad}");
        }
        let d = tempfile::tempdir().unwrap();
        assert_eq!(fresh_dir_name(d.path(), 7), v);
        std::fs::create_dir(d.path().join(&v)).unwrap();
        assert_eq!(fresh_dir_name(d.path(), 7), format!("{v}-1"));
    }

    #[test]
    fn the_written_layout_is_what_write_anchor_writes() {
        let s = set(&[("b", 2, 5), ("a", 1, 3), ("c", 3, 0)]);
        let prefix = anchor_prefix(&s, 12).unwrap();
        let mut bytes = Vec::new();
        write_anchor(&s, 12, &mut bytes).unwrap();
        assert_eq!(&bytes[..prefix.len()], &prefix[..]);
        let layout = FileLayout::written(&s, prefix.len() as u64);
        assert_eq!(layout.size, bytes.len() as u64);
        let (_, back) = read_anchor(bytes.clone()).unwrap();
        assert_eq!(FileLayout::on_disk(&back, bytes.len() as u64), layout);
    }

    #[test]
    fn plans() {
        let v1 = set(&[("a", 1, 4), ("b", 2, 4)]);
        let old = FileLayout::written(&v1, 64);
        // Same tensors: a link, even if the header length moved.
        assert!(matches!(
            plan(Some(&old), &FileLayout::written(&v1, 72), &v1),
            Plan::Link(_)
        ));
        // One tensor changed, same layout: patch just it.
        let v2 = set(&[("a", 1, 4), ("b", 9, 4)]);
        match plan(Some(&old), &FileLayout::written(&v2, 64), &v2) {
            Plan::Patch(changed) => assert_eq!(changed, vec![1]),
            _ => panic!("expected a patch"),
        }
        // Header length or sizes moved, a tensor came or went, no previous
        // file: written in full.
        let v3 = set(&[("a", 1, 4), ("b", 9, 6)]);
        let v4 = set(&[("a", 1, 4), ("b", 9, 4), ("c", 0, 1)]);
        for (s, prefix, old) in [
            (&v2, 72, Some(&old)),
            (&v3, 64, Some(&old)),
            (&v4, 64, Some(&old)),
            (&v2, 64, None),
        ] {
            let p = plan(old, &FileLayout::written(s, prefix), s);
            assert!(matches!(p, Plan::Full));
        }
    }

    #[test]
    fn reuse_gives_the_bytes_of_a_full_write() {
        let d = tempfile::tempdir().unwrap();
        let out = d.path();
        let v0 = replica(0, set(&[("a", 1, 4000), ("b", 2, 3000)]), b"{}");
        let io = materialize(out, &v0, None).unwrap();
        assert_eq!(io.reused, 0);
        let (state, _) = load_local(out).unwrap();

        let v1 = replica(1, set(&[("a", 1, 4000), ("b", 7, 3000)]), b"{}");
        let io = materialize(out, &v1, Some(&state)).unwrap();
        let mut want = Vec::new();
        write_anchor(&v1.tensors["model.safetensors"], 1, &mut want).unwrap();
        assert_eq!(file(out, "model.safetensors"), want);
        assert_eq!(file(out, "config.json"), b"{}");
        let prefix = anchor_prefix(&v1.tensors["model.safetensors"], 1).unwrap();
        assert_eq!(io.written, prefix.len() as u64 + 3000);
        assert_eq!(io.written + io.reused, want.len() as u64 + 2);
        // Only the new version's directory is left, and it verifies.
        assert_eq!(std::fs::read_dir(out.join("versions")).unwrap().count(), 1);
        let (state, r) = load_local(out).unwrap();
        assert_eq!((state.version, r.tensors.len(), r.files.len()), (1, 1, 1));
    }

    #[test]
    fn a_state_from_before_layouts_loads_and_is_reused_from() {
        let d = tempfile::tempdir().unwrap();
        let out = d.path();
        let v0 = replica(0, set(&[("a", 1, 400), ("b", 2, 300)]), b"{}");
        materialize(out, &v0, None).unwrap();
        // What older releases wrote: version and file digests only.
        let old = serde_json::json!({
            "version": 0,
            "digests": {"model.safetensors": v0.tensors["model.safetensors"].digest().to_string()},
        });
        std::fs::write(state_path(out), old.to_string()).unwrap();
        let (state, _) = load_local(out).unwrap();
        assert_eq!(state.dir.as_deref(), Some(format!("{:020}", 0).as_str()));
        assert!(state.layouts.contains_key("model.safetensors"));
        let v1 = replica(1, set(&[("a", 1, 400), ("b", 5, 300)]), b"{}");
        let io = materialize(out, &v1, Some(&state)).unwrap();
        assert!(io.reused > 400, "{io:?}");

        // A state whose layout does not match the files is doubtful.
        let mut bad: serde_json::Value =
            serde_json::from_slice(&std::fs::read(state_path(out)).unwrap()).unwrap();
        bad["layouts"]["model.safetensors"]["size"] = 1.into();
        std::fs::write(state_path(out), bad.to_string()).unwrap();
        assert!(load_local(out).is_none());
        // So is one naming a directory outside versions/.
        bad["layouts"] = serde_json::json!({});
        bad["dir"] = "../..".into();
        std::fs::write(state_path(out), bad.to_string()).unwrap();
        assert!(load_local(out).is_none());
    }

    #[test]
    fn a_crash_after_the_switch_never_replaces_the_current_directory() {
        let d = tempfile::tempdir().unwrap();
        let out = d.path();
        let v0 = replica(0, set(&[("a", 1, 40)]), b"{}");
        materialize(out, &v0, None).unwrap();
        let (s0, _) = load_local(out).unwrap();
        let v1 = replica(1, set(&[("a", 2, 40)]), b"{}");
        materialize(out, &v1, Some(&s0)).unwrap();
        // As if killed after `current` switched to v1 but before the state
        // and cleanup: the state still names v0, whose directory is back.
        let v0_dir = out.join("versions").join(format!("{:020}", 0));
        std::fs::create_dir(&v0_dir).unwrap();
        let v1_dir = out.join("versions").join(format!("{:020}", 1));
        for f in ["model.safetensors", "config.json"] {
            let mut body = Vec::new();
            if f == "config.json" {
                body.extend_from_slice(b"{}");
            } else {
                write_anchor(&v0.tensors[f], 0, &mut body).unwrap();
            }
            std::fs::write(v0_dir.join(f), body).unwrap();
        }
        std::fs::write(state_path(out), serde_json::to_vec(&s0).unwrap()).unwrap();
        let (s, _) = load_local(out).unwrap();
        assert_eq!(s.version, 0);
        // Materializing v1 again goes to a new directory; v1's stays whole
        // until `current` has left it.
        let ino = |p: &Path| std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(p).unwrap());
        let before = ino(&v1_dir.join("model.safetensors"));
        materialize(out, &v1, Some(&s)).unwrap();
        let link = std::fs::read_link(out.join("current")).unwrap();
        assert_eq!(link, Path::new("versions").join(format!("{:020}-1", 1)));
        assert_ne!(ino(&out.join("current/model.safetensors")), before);
        assert_eq!(load_local(out).unwrap().0.version, 1);
    }
}
