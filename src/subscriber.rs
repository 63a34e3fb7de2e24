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

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::codec::{apply_delta, read_anchor, write_anchor};
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
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
struct LocalState {
    version: u64,
    /// Digest of each safetensors file of the materialized version.
    digests: BTreeMap<String, String>,
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
    let Some(&newest) = versions_after(store, None).await?.last() else {
        return Ok(None);
    };
    let local = load_local(out);
    if let Some((state, _)) = &local {
        if state.version == newest {
            return Ok(Some(CaughtUp {
                version: newest,
                previous: Some(newest),
                downloaded: 0,
                deltas_applied: 0,
                from_anchor: false,
                repairs: 0,
                changed_tensors: Vec::new(),
            }));
        }
    }
    let target = read_manifest(store, newest)
        .await?
        .ok_or_else(|| Error::metadata("manifest", format!("version {newest} vanished")))?;
    let mut downloaded = 0u64;
    let mut repairs = 0u64;
    let previous = local.as_ref().map(|(s, _)| s.version);

    // Replay from the local state when it is recent and the deltas are cheaper
    // than the anchor.
    let mut result: Option<(Replica, u64)> = None;
    if let Some((state, replica)) = local {
        if state.version >= target.anchor_version && state.version < newest {
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
    materialize(out, &replica)?;
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
    }))
}

/// Downloads an object and checks it against its manifest entry.
async fn fetch(store: &Store, o: &ObjectEntry) -> Result<Vec<u8>> {
    let body = store
        .get(&o.key)
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
async fn apply_manifest(store: &Store, r: &mut Replica, m: &Manifest) -> Result<u64> {
    let mut bytes = 0;
    for o in &m.objects {
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
    let mut bytes = apply_manifest(store, &mut r, &m).await?;
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
        bytes += apply_manifest(store, &mut r, &m).await?;
        applied += 1;
    }
    Ok((r, bytes, applied))
}

fn state_path(out: &Path) -> PathBuf {
    out.join(".state.json")
}

fn version_dir(out: &Path, version: u64) -> PathBuf {
    out.join("versions").join(format!("{version:020}"))
}

/// Loads and verifies the materialized version; `None` if absent or doubtful.
fn load_local(out: &Path) -> Option<(LocalState, Replica)> {
    let state: LocalState = serde_json::from_slice(&std::fs::read(state_path(out)).ok()?).ok()?;
    let dir = version_dir(out, state.version);
    let mut r = Replica {
        version: state.version,
        tensors: BTreeMap::new(),
        files: BTreeMap::new(),
        changed: Default::default(),
    };
    for entry in std::fs::read_dir(&dir).ok()? {
        let entry = entry.ok()?;
        let name = entry.file_name().to_str()?.to_string();
        let bytes = std::fs::read(entry.path()).ok()?;
        if name.ends_with(".safetensors") {
            let (_, set) = read_anchor(bytes).ok()?;
            if state.digests.get(&name) != Some(&set.digest().to_string()) {
                tracing::warn!(file = %name, "materialized file does not verify; re-bootstrapping");
                return None;
            }
            r.tensors.insert(name, set);
        } else {
            r.files.insert(name, bytes);
        }
    }
    (r.tensors.len() == state.digests.len()).then_some((state, r))
}

/// Writes the version into its own directory, switches `current` to it, records
/// the state, and removes the previous version's directory.
fn materialize(out: &Path, r: &Replica) -> Result<()> {
    let io = |what: &str, p: &Path, e| Error::io(format!("{what} {}", p.display()), e);
    let dir = version_dir(out, r.version);
    let tmp = dir.with_extension("partial");
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).map_err(|e| io("creating", &tmp, e))?;
    for (name, set) in &r.tensors {
        if !is_safe_file_name(name) || name.contains('/') {
            return Err(Error::metadata(
                "manifest",
                format!("unsafe file name `{name}`"),
            ));
        }
        let p = tmp.join(name);
        let mut f =
            std::io::BufWriter::new(std::fs::File::create(&p).map_err(|e| io("creating", &p, e))?);
        write_anchor(set, r.version, &mut f)?;
        use std::io::Write;
        f.flush().map_err(|e| io("writing", &p, e))?;
    }
    for (name, body) in &r.files {
        if !is_safe_file_name(name) || name.contains('/') {
            return Err(Error::metadata(
                "manifest",
                format!("unsafe file name `{name}`"),
            ));
        }
        let p = tmp.join(name);
        std::fs::write(&p, body).map_err(|e| io("writing", &p, e))?;
    }
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::rename(&tmp, &dir).map_err(|e| io("renaming", &tmp, e))?;
    // Atomic switch: a new symlink renamed over the old one.
    let link = out.join("current");
    let link_tmp = out.join(".current.tmp");
    let _ = std::fs::remove_file(&link_tmp);
    let target = Path::new("versions").join(format!("{:020}", r.version));
    std::os::unix::fs::symlink(&target, &link_tmp).map_err(|e| io("linking", &link_tmp, e))?;
    std::fs::rename(&link_tmp, &link).map_err(|e| io("switching", &link, e))?;
    let state = LocalState {
        version: r.version,
        digests: r
            .tensors
            .iter()
            .map(|(n, s)| (n.clone(), s.digest().to_string()))
            .collect(),
    };
    let sp = state_path(out);
    let sp_tmp = out.join(".state.json.tmp");
    std::fs::write(
        &sp_tmp,
        serde_json::to_vec_pretty(&state).expect("state serializes"),
    )
    .map_err(|e| io("writing", &sp_tmp, e))?;
    std::fs::rename(&sp_tmp, &sp).map_err(|e| io("renaming", &sp_tmp, e))?;
    // Old versions go once nothing points at them.
    if let Ok(entries) = std::fs::read_dir(out.join("versions")) {
        for e in entries.flatten() {
            if e.path() != dir {
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
    }
    Ok(())
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

/// Catches up forever: after each attempt, waits for a notification or the
/// poll interval, whichever comes first (bursts of notifications coalesce).
/// Updates the shared status and, with an id, the bucket registration.
pub async fn run_daemon(store: &Store, cfg: &DaemonConfig, shared: &crate::server::Shared) -> ! {
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
                if let Some(id) = &cfg.id {
                    let reg = crate::notify::Registration {
                        id: id.clone(),
                        notify_url: cfg.notify_url.clone(),
                        version: Some(c.version),
                        updated_at: crate::notify::unix_now(),
                    };
                    if let Err(e) = crate::notify::register(store, &reg).await {
                        tracing::warn!(error = %e, "registration failed");
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
