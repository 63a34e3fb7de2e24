//! The publisher's persisted state: a snapshot of the last committed version,
//! kept up to date **in place**, and `state.json`.
//!
//! ```text
//! <state>/state.json                 version, anchor bookkeeping, per-tensor digests, pending commit
//! <state>/snapshot/<file>            plain safetensors files of the last committed version
//! <state>/journal/<version>/<file>   the delta objects of a version being committed
//! <state>/next/<file>                an anchor's files while it is being committed
//! ```
//!
//! A delta version costs its changes here, not the model: after the commit,
//! the version's own delta objects (the journal, written and fsynced before
//! the commit) are applied to the memory-mapped snapshot files in place. An
//! anchor writes the new snapshot files once, under `next/`, uploads the
//! anchor objects from them, and swaps the directories after the commit.
//!
//! Crash safety. `state.json` is replaced atomically (write, fsync, rename,
//! fsync) and names a *pending* commit before the manifest is created. On
//! [`Snapshot::load`] every snapshot file is verified with a full digest pass
//! (the only whole-model read, once per process start) and the pending commit
//! is resolved against the bucket: if the manifest of the pending version
//! exists with this publisher's writer token, the commit happened — the
//! snapshot is brought to it (the journal's deltas applied if they were not,
//! or `next/` swapped in) and verified against the digests recorded for it;
//! if the manifest is absent or another writer's, the pending commit is
//! dropped. Anything that does not verify leaves no trusted snapshot: the
//! next version is an anchor. A process kill never loses the page cache, so
//! the journal's in-place apply is interrupted at worst mid-way; that state
//! verifies as neither side and costs one anchor, never a wrong delta.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::codec::apply_delta;
use crate::digest::Digest;
use crate::error::{Error, Result};
use crate::fsio::{io_err, sync_dir, write_atomic};
use crate::protocol::VersionKind;
use crate::tensors::{Digests, TensorSet};

/// Digests of one snapshot tensor file: per tensor, in name order.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileDigests {
    /// Tensor name → digest (16 hex digits).
    pub tensors: BTreeMap<String, String>,
}

impl FileDigests {
    /// The digests a tensor set carries.
    pub fn of(set: &TensorSet) -> FileDigests {
        FileDigests {
            tensors: set
                .tensors()
                .iter()
                .map(|t| (t.name.clone(), t.digest.to_string()))
                .collect(),
        }
    }

    fn parsed(&self) -> Option<Vec<Digest>> {
        self.tensors.values().map(|d| Digest::parse(d)).collect()
    }
}

/// A commit in flight, recorded before the manifest is created.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Pending {
    /// The version being committed.
    pub version: u64,
    /// Its writer token (the manifest's `writer` if the commit happened).
    pub writer: String,
    /// Anchor (files under `next/`) or delta (objects under `journal/`).
    pub kind: VersionKind,
    /// What the state becomes once the commit is recorded.
    pub after: Box<State>,
}

/// `state.json`.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct State {
    /// The last committed version.
    pub version: u64,
    /// The writer token of that commit.
    #[serde(default)]
    pub writer: String,
    /// Its newest anchor.
    pub anchor_version: u64,
    /// Bytes of that anchor's objects.
    pub anchor_bytes: u64,
    /// Bytes of the versions since the anchor (what a newcomer replays).
    pub bytes_since_anchor: u64,
    /// The trainer step of the last version, when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step: Option<u64>,
    /// How many ranks published the last version together (distributed
    /// publish); absent for a publisher alone. A rank whose world changed
    /// publishes an anchor: the version's set of safetensors files is the
    /// union of the ranks' ([`super::dist`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub world: Option<u32>,
    /// Non-tensor files of the last version: name → (size, BLAKE3).
    pub files: BTreeMap<String, (u64, String)>,
    /// Tensor files of the snapshot and their digests.
    pub tensor_files: BTreeMap<String, FileDigests>,
    /// A commit in flight.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pending: Option<Pending>,
}

/// Whether the bucket has a pending commit's manifest, by whom.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Committed {
    /// The manifest exists with our writer token.
    Ours,
    /// No manifest, or another writer's.
    NotOurs,
}

/// The snapshot of the last committed version.
pub struct Snapshot {
    dir: PathBuf,
    /// The recorded state (no pending commit once loaded).
    pub state: State,
    /// The snapshot's tensor files, mapped for writing, digests set.
    pub sets: BTreeMap<String, TensorSet>,
}

impl Snapshot {
    fn state_path(dir: &Path) -> PathBuf {
        dir.join("state.json")
    }

    /// The snapshot directory.
    pub fn files_dir(dir: &Path) -> PathBuf {
        dir.join("snapshot")
    }

    /// Where an anchor's new snapshot files are written before its commit.
    pub fn next_dir(dir: &Path) -> PathBuf {
        dir.join("next")
    }

    fn journal_dir(dir: &Path, version: u64) -> PathBuf {
        dir.join("journal").join(format!("{version:020}"))
    }

    /// Reads `state.json` without verifying anything (`None` if absent or
    /// unreadable).
    pub fn read_state(dir: &Path) -> Option<State> {
        let bytes = std::fs::read(Self::state_path(dir)).ok()?;
        match serde_json::from_slice(&bytes) {
            Ok(s) => Some(s),
            Err(e) => {
                tracing::warn!(error = %e, "publisher state unreadable; the next version will be an anchor");
                None
            }
        }
    }

    /// Loads and verifies the snapshot, resolving a pending commit with
    /// `committed` (asked of the bucket for the pending version and writer).
    /// `Ok(None)`: no trusted snapshot (a fresh start, or anything in doubt);
    /// the state read, if any, is returned for its numbering.
    pub async fn load<F, Fut>(dir: &Path, committed: F) -> (Option<Snapshot>, Option<State>)
    where
        F: FnOnce(u64, String) -> Fut,
        Fut: std::future::Future<Output = Result<Committed>>,
    {
        let Some(mut state) = Self::read_state(dir) else {
            return (None, None);
        };
        let mut target: Option<(State, VersionKind)> = None;
        if let Some(p) = state.pending.take() {
            match committed(p.version, p.writer.clone()).await {
                Ok(Committed::Ours) => target = Some((*p.after, p.kind)),
                Ok(Committed::NotOurs) => {
                    tracing::info!(
                        version = p.version,
                        "a pending commit did not happen; dropped"
                    );
                }
                Err(e) => {
                    tracing::warn!(error = %e, "cannot resolve the pending commit; the next version will be an anchor");
                    return (None, Some(state));
                }
            }
        }
        let base = state.clone();
        match Self::verify(dir, state, target) {
            Ok(s) => {
                let recorded = s.state.clone();
                (Some(s), Some(recorded))
            }
            Err(e) => {
                tracing::warn!(error = %e, "publisher snapshot does not verify; the next version will be an anchor");
                (None, Some(base))
            }
        }
    }

    fn verify(dir: &Path, state: State, target: Option<(State, VersionKind)>) -> Result<Snapshot> {
        let mut state = state;
        if let Some((after, VersionKind::Anchor)) = &target {
            // The commit happened: `next/` becomes the snapshot (unless the
            // swap already did).
            let next = Self::next_dir(dir);
            if next.exists() {
                Self::swap_in_next(dir)?;
            }
            state = after.clone();
        }
        let mut sets = Self::map_verified(dir, &state.tensor_files).or_else(|e| match &target {
            // Already swapped or applied: the snapshot is at the target.
            Some((after, _)) => {
                state = after.clone();
                Self::map_verified(dir, &after.tensor_files)
            }
            None => Err(e),
        })?;
        if let Some((after, VersionKind::Delta)) = target
            && state.version != after.version
        {
            // The snapshot is at the base: apply the journal.
            let journal = Self::journal_dir(dir, after.version);
            for (name, set) in sets.iter_mut() {
                let p = journal.join(format!("{name}.delta"));
                let delta = std::fs::read(&p).map_err(|e| io_err("reading", &p, e))?;
                apply_delta(set, &delta)?;
                if FileDigests::of(set) != after.tensor_files[name] {
                    return Err(Error::Integrity {
                        scope: format!("publisher snapshot {name} after replaying the journal"),
                        expected: "the digests recorded for the commit".into(),
                        actual: "others".into(),
                    });
                }
                set.flush()?;
            }
            state = after;
        }
        let snap = Snapshot {
            dir: dir.to_path_buf(),
            state,
            sets,
        };
        snap.record()?;
        let _ = std::fs::remove_dir_all(dir.join("journal"));
        Ok(snap)
    }

    /// Maps every snapshot file for writing and checks it against `files`
    /// with a full digest pass.
    fn map_verified(
        dir: &Path,
        files: &BTreeMap<String, FileDigests>,
    ) -> Result<BTreeMap<String, TensorSet>> {
        let mut sets = BTreeMap::new();
        for (name, want) in files {
            let path = Self::files_dir(dir).join(name);
            let set = TensorSet::map(&path, true, Digests::Compute)?;
            if FileDigests::of(&set) != *want {
                return Err(Error::Integrity {
                    scope: format!("publisher snapshot {name}"),
                    expected: "the digests in state.json".into(),
                    actual: "others".into(),
                });
            }
            sets.insert(name.clone(), set);
        }
        if files.is_empty() {
            return Err(Error::NotFound("the state lists no snapshot file".into()));
        }
        Ok(sets)
    }

    fn swap_in_next(dir: &Path) -> Result<()> {
        let (snap, next, old) = (
            Self::files_dir(dir),
            Self::next_dir(dir),
            dir.join("snapshot.old"),
        );
        let _ = std::fs::remove_dir_all(&old);
        if snap.exists() {
            std::fs::rename(&snap, &old).map_err(|e| io_err("renaming", &snap, e))?;
        }
        std::fs::rename(&next, &snap).map_err(|e| io_err("renaming", &next, e))?;
        sync_dir(dir)?;
        let _ = std::fs::remove_dir_all(&old);
        Ok(())
    }

    /// Writes `state.json` (no pending commit).
    fn record(&self) -> Result<()> {
        write_state(&self.dir, &self.state)
    }

    /// Records a delta commit about to happen: its objects go to the journal
    /// (fsynced) and `state.json` names it, before the manifest is created.
    pub fn prepare_delta(
        &mut self,
        version: u64,
        writer: &str,
        deltas: &[(String, Vec<u8>)],
        after: State,
    ) -> Result<()> {
        let journal = Self::journal_dir(&self.dir, version);
        let _ = std::fs::remove_dir_all(self.dir.join("journal"));
        for (name, bytes) in deltas {
            let p = journal.join(format!("{name}.delta"));
            if let Some(parent) = p.parent() {
                std::fs::create_dir_all(parent).map_err(|e| io_err("creating", parent, e))?;
            }
            write_atomic(&p, bytes)?;
        }
        self.set_pending(Pending {
            version,
            writer: writer.to_string(),
            kind: VersionKind::Delta,
            after: Box::new(after),
        })
    }

    /// Records an anchor commit about to happen (its files are in `next/`).
    pub fn prepare_anchor(&mut self, version: u64, writer: &str, after: State) -> Result<()> {
        self.set_pending(Pending {
            version,
            writer: writer.to_string(),
            kind: VersionKind::Anchor,
            after: Box::new(after),
        })
    }

    fn set_pending(&mut self, p: Pending) -> Result<()> {
        let mut s = self.state.clone();
        s.pending = Some(p);
        write_state(&self.dir, &s)
    }

    /// Stops trusting the snapshot, durably: `state.json` keeps the
    /// numbering (version, writer, step) but lists no snapshot file, so
    /// that neither this process nor the next one builds a delta on it —
    /// the next version is an anchor, from a full read of its checkpoint.
    /// Called when something failed its integrity check.
    pub fn distrust(dir: &Path, state: &State) -> Result<()> {
        let mut s = state.clone();
        s.pending = None;
        s.tensor_files.clear();
        let _ = std::fs::remove_dir_all(dir.join("journal"));
        let _ = std::fs::remove_dir_all(Self::next_dir(dir));
        write_state(dir, &s)
    }

    /// Forgets a pending commit that did not happen (a lost race).
    pub fn abandon(&mut self) -> Result<()> {
        let _ = std::fs::remove_dir_all(self.dir.join("journal"));
        let _ = std::fs::remove_dir_all(Self::next_dir(&self.dir));
        self.record()
    }

    /// After a delta commit: applies the journal's deltas to the mapped
    /// snapshot in place and records the new state.
    pub fn finish_delta(&mut self, deltas: &[(String, Vec<u8>)], after: State) -> Result<()> {
        for (name, bytes) in deltas {
            let set = self.sets.get_mut(name).ok_or_else(|| {
                Error::NotFound(format!("publisher snapshot has no file `{name}`"))
            })?;
            apply_delta(set, bytes)?;
        }
        for set in self.sets.values() {
            set.flush()?;
        }
        self.state = after;
        self.record()?;
        let _ = std::fs::remove_dir_all(self.dir.join("journal"));
        Ok(())
    }
}

/// Writes `state.json` atomically.
pub(crate) fn write_state(dir: &Path, state: &State) -> Result<()> {
    let body = serde_json::to_vec_pretty(state).expect("state serializes");
    write_atomic(&Snapshot::state_path(dir), &body)
}

/// After an anchor commit: swaps `next/` in as the snapshot and loads it
/// (digests known, no pass over the data).
pub fn install_anchor(dir: &Path, after: State) -> Result<Snapshot> {
    Snapshot::swap_in_next(dir)?;
    let mut sets = BTreeMap::new();
    for (name, d) in &after.tensor_files {
        let path = Snapshot::files_dir(dir).join(name);
        let mut set = TensorSet::map(&path, true, Digests::Skip)?;
        let digests = d.parsed().ok_or_else(|| {
            Error::metadata(
                "state.json",
                format!("`{name}`: digests are not 16 hex digits"),
            )
        })?;
        set.assume_digests(&digests)?;
        sets.insert(name.clone(), set);
    }
    let snap = Snapshot {
        dir: dir.to_path_buf(),
        state: after,
        sets,
    };
    snap.record()?;
    Ok(snap)
}
