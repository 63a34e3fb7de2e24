//! The publisher's persisted state: a snapshot of the last committed
//! version, `state.json`, and — on a disk — the overlay of the delta versions
//! since the snapshot's own.
//!
//! ```text
//! <state>/state.json                  version, anchor bookkeeping, per-tensor digests, stamps, overlay, pending commit
//! <state>/snapshot/<file>             plain safetensors files (the last anchor's, or the last version's)
//! <state>/overlay/<version>/<file>.delta  the delta objects of the versions since the snapshot's (overlay mode)
//! <state>/journal/<version>/<file>.delta  the delta objects of a version being committed
//! <state>/next/<file>                 an anchor's files while it is being committed
//! <state>/context/<file>.ctx          in place: the `compact2` context of the last version's delta
//! ```
//!
//! A delta version costs its changes here, not the model. Its delta objects
//! are written to the journal (fsynced) before the commit; after it they are
//! applied to the memory-mapped snapshot, all or nothing, verified against
//! the digests they record. Where that apply lands is the [`StateMode`]:
//!
//! - **in place** (the default on tmpfs and ramfs): the snapshot's files are
//!   mapped shared and patched, so they always hold the last version. On a
//!   disk this writes back every page a version changes — at an RL step's
//!   1–2% density, every page of the trained tensors, the whole model per
//!   version.
//! - **overlay** (the default elsewhere): the snapshot's files stay as the
//!   last anchor wrote them; each delta version's objects move from the
//!   journal to `overlay/<version>/` and are applied to a private
//!   copy-on-write map of the files. The disk takes the delta (once, in the
//!   journal) and `state.json`; memory holds the pages the versions since the
//!   anchor changed. The next anchor replaces the snapshot and empties the
//!   overlay (its compaction).
//! - **previous** (`--state-mode previous`): no copy past an anchor's
//!   first delta. The checkpoint each version was published from (the
//!   trainer's step directory) is the next delta's base: `state.json`
//!   records its files' paths (`base`) and stamps, and they are mapped
//!   read-only. A commit needs no journal and applies nothing (the
//!   checkpoint holds the version); [`Snapshot::base_holds`] is checked
//!   before every publish reads them, and a base that changed means an
//!   anchor. With `compact2`, the delta objects since the anchor go to
//!   `overlay/<version>/` (the `chain`) to rebuild the contexts at start.
//!
//! **Contexts** (`compact2`, docs/format.md §6.3). The snapshot holds, per
//! file, the changes of the delta that produced its version: what the next
//! delta is coded against. They come out of applying each delta (as on a
//! subscriber), start empty at an anchor, and are rebuilt at every start:
//! over an overlay by replaying it; in place from `context/`, written after
//! each version (4 bytes per changed element; the in-place files take far
//! more). A context that does not lead to its file's digest is dropped: the
//! next delta of that file is then written without one, as after an anchor.
//!
//! An anchor writes the new snapshot files once, under `next/` (fsynced),
//! uploads the anchor objects from them, and swaps the directories after the
//! commit.
//!
//! **Trust by stamp.** `state.json` records each snapshot file's stamp
//! (size, inode, modification and change times, and the BLAKE3 of its
//! header bytes), taken once the file was durable. A start that finds every
//! stamp as recorded trusts the files without reading them (the way git
//! trusts its index); any difference, a state of an older release without
//! stamps, or a commit left in flight, means one full digest pass over the
//! files. The overlay's objects are checked against their recorded size and
//! BLAKE3 and applied with the codec's own checks (base and result digests)
//! at every start. What a version touches is verified as it is applied: O(changed)
//! digests. `weightcast verify --state` verifies everything, whatever the
//! stamps say.
//!
//! Crash safety. `state.json` is replaced atomically (write, fsync, rename,
//! fsync) and names a *pending* commit before the manifest is created. On
//! [`Snapshot::load`] the pending commit is resolved against the bucket: if
//! the manifest of the pending version exists with this publisher's writer
//! token, the commit happened — the snapshot is brought to it (the journal's
//! deltas applied if they were not, or `next/` swapped in) and verified
//! against the digests recorded for it; if the manifest is absent or another
//! writer's, the pending commit is dropped. Anything that does not verify —
//! a file whose content changed, an overlay object torn or missing — leaves
//! no trusted snapshot: the next version is an anchor. A process kill never
//! loses the page cache, so an in-place apply is interrupted at worst
//! mid-way; that state verifies as neither side and costs one anchor, never a
//! wrong delta.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::codec::{Context, apply_delta_ctx};
use crate::digest::Digest;
use crate::error::{Error, Result};
use crate::fsio::{Stamp, io_err, sync_dir, write_atomic, write_atomic_after};
use crate::protocol::VersionKind;
use crate::tensors::{Digests, TensorSet};

/// How the snapshot follows the versions (`--state-mode`; see the module
/// documentation).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum StateMode {
    /// In place where the state directory is in memory (tmpfs, ramfs), an
    /// overlay elsewhere.
    #[default]
    Auto,
    /// Each delta patched into the snapshot's files.
    InPlace,
    /// The snapshot's files kept as the last anchor wrote them; the deltas
    /// since beside them, applied to a private copy-on-write map.
    Overlay,
    /// No copy of the model past an anchor's first delta: the checkpoint
    /// each version was published from (the trainer's step directory) is
    /// the next delta's base, trusted by its stamps and mapped read-only.
    /// The trainer must keep a checkpoint's files, unchanged, until the next
    /// one is published; if it does not, the next version is an anchor.
    /// Checkpoints on disk only.
    Previous,
}

impl std::str::FromStr for StateMode {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "auto" => Ok(StateMode::Auto),
            "in-place" => Ok(StateMode::InPlace),
            "overlay" => Ok(StateMode::Overlay),
            "previous" => Ok(StateMode::Previous),
            other => Err(Error::Config(format!(
                "state mode `{other}`: expected auto, in-place, overlay or previous"
            ))),
        }
    }
}

/// `auto` keeps an overlay only for a snapshot of at most this share of the
/// memory available: the overlay's last version lives in anonymous memory,
/// at RL densities all of it (see [`StateMode::resolve`]).
pub const OVERLAY_MEMORY_SHARE: u64 = 4;

impl StateMode {
    /// `InPlace` or `Overlay` for the state directory `dir`, whose snapshot
    /// files take `snapshot_bytes`.
    ///
    /// `auto` on a disk picks the overlay, which writes the delta to the disk
    /// instead of every page a version touches, unless the snapshot is more
    /// than a quarter of the memory available (`MemAvailable`, or a cgroup's
    /// limit): the overlay holds the last version in private pages, and at
    /// RL densities every page is one, so its anonymous memory is the whole
    /// snapshot. Memory the node cannot spare weighs more than disk writes.
    pub fn resolve(self, dir: &Path, snapshot_bytes: u64) -> StateMode {
        self.resolve_with(
            crate::fsio::in_memory(dir),
            snapshot_bytes,
            crate::fsio::memory_available(),
        )
    }

    fn resolve_with(self, in_memory: bool, snapshot: u64, available: Option<u64>) -> StateMode {
        match self {
            StateMode::Auto if in_memory => StateMode::InPlace,
            StateMode::Auto if available.is_some_and(|a| snapshot > a / OVERLAY_MEMORY_SHARE) => {
                tracing::warn!(
                    snapshot_bytes = snapshot,
                    memory_available = available,
                    "--state-mode auto: the snapshot is more than a quarter of the memory \
                     available, so it is patched in place (each version writes the pages it \
                     touches to the disk) rather than kept as an overlay (which would hold \
                     it all in anonymous memory); --state-mode overlay forces the overlay, \
                     and --state-mode previous needs neither where the trainer keeps each \
                     step's checkpoint until the next is published"
                );
                StateMode::InPlace
            }
            StateMode::Auto => StateMode::Overlay,
            other => other,
        }
    }
}

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
    /// What the state becomes once the commit is recorded (its snapshot
    /// fields — overlay, stamps — are the snapshot's to fill in).
    pub after: Box<State>,
}

/// A delta version of the overlay: its objects, `overlay/<version>/<file>.delta`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct OverlayVersion {
    /// The version.
    pub version: u64,
    /// Tensor file → (size, BLAKE3) of its delta object.
    pub objects: BTreeMap<String, (u64, String)>,
}

impl OverlayVersion {
    /// Version `version`'s delta objects (file → bytes), by size and BLAKE3.
    fn of(version: u64, deltas: &[(String, Vec<u8>)]) -> OverlayVersion {
        OverlayVersion {
            version,
            objects: deltas
                .iter()
                .map(|(n, d)| {
                    (
                        n.clone(),
                        (
                            d.len() as u64,
                            crate::digest::blake3_of(d).to_hex().to_string(),
                        ),
                    )
                })
                .collect(),
        }
    }
}

/// What a snapshot file looked like once it was durable.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileStamp {
    /// Its size.
    pub size: u64,
    /// Inode, modification and change times.
    pub stamp: Stamp,
    /// BLAKE3 of its length and header bytes.
    pub header_blake3: String,
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
    /// Tensor files of the last version and their digests.
    pub tensor_files: BTreeMap<String, FileDigests>,
    /// The delta versions after the snapshot files' own version, in order
    /// (overlay mode): their objects bring the files to `version`. Empty:
    /// the files hold `version`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub overlay: Vec<OverlayVersion>,
    /// Digests of the snapshot files as they are on disk, when the overlay
    /// is not empty (otherwise `tensor_files`).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub snapshot_files: BTreeMap<String, FileDigests>,
    /// Stamps of the snapshot files, recorded once they were durable (none:
    /// verified in full at the next start).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub stamps: BTreeMap<String, FileStamp>,
    /// `previous` mode: tensor file → the checkpoint file that holds it at
    /// `version` (the trainer's own; never written here). Empty: the files
    /// are `snapshot/<name>`.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub base: BTreeMap<String, PathBuf>,
    /// A commit in flight.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pending: Option<Pending>,
}

impl State {
    /// Digests of the snapshot files as they are on disk.
    fn disk_digests(&self) -> &BTreeMap<String, FileDigests> {
        if self.overlay.is_empty() {
            &self.tensor_files
        } else {
            &self.snapshot_files
        }
    }

    /// `self` with no snapshot of its own: the next version is an anchor.
    fn without_snapshot(mut self) -> State {
        self.pending = None;
        self.tensor_files.clear();
        self.overlay.clear();
        self.snapshot_files.clear();
        self.stamps.clear();
        self.base.clear();
        self
    }

    /// Where snapshot file `name` is: the checkpoint's own file (`previous`
    /// mode), else `snapshot/<name>` under `dir`.
    fn file_path(&self, dir: &Path, name: &str) -> PathBuf {
        match self.base.get(name) {
            Some(p) => p.clone(),
            None => Snapshot::files_dir(dir).join(name),
        }
    }
}

/// Whether the bucket has a pending commit's manifest, by whom.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Committed {
    /// The manifest exists with our writer token.
    Ours,
    /// No manifest, or another writer's.
    NotOurs,
}

/// What `weightcast verify --state` found.
#[derive(Clone, Debug, Serialize)]
pub struct Verified {
    /// The version the state records.
    pub version: u64,
    /// Snapshot files read in full.
    pub files: usize,
    /// Bytes of tensor data read.
    pub bytes: u64,
    /// Overlay versions applied on top of them.
    pub overlay_versions: usize,
    /// Whether everything verified.
    pub ok: bool,
    /// Why not (the snapshot is then no longer trusted: the next version is
    /// an anchor).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// How a start checked the snapshot's files.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Check {
    /// Trusted by their stamps: nothing read.
    Stamps,
    /// One full digest pass (a stamp differed, none was recorded, or a
    /// commit was in flight).
    Full,
    /// Written by this process (an anchor's files, digests computed from
    /// the bytes written).
    Written,
}

/// The snapshot of the last committed version.
pub struct Snapshot {
    dir: PathBuf,
    /// `InPlace` or `Overlay`.
    mode: StateMode,
    /// How its files were checked when it was opened.
    check: Check,
    /// The recorded state (no pending commit once loaded).
    pub state: State,
    /// The snapshot's tensor files at `state.version`, mapped (shared in
    /// place, private over an overlay), digests set.
    pub sets: BTreeMap<String, TensorSet>,
    /// Per file, the `compact2` context of the delta that produced
    /// `state.version` (none after an anchor).
    pub contexts: BTreeMap<String, Context>,
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

    fn context_path(dir: &Path, name: &str) -> PathBuf {
        dir.join("context").join(format!("{name}.ctx"))
    }

    /// The saved contexts that lead to the files' digests now.
    fn load_contexts(&mut self) {
        for (name, set) in &self.sets {
            let p = Self::context_path(&self.dir, name);
            let Ok(bytes) = std::fs::read(&p) else {
                continue;
            };
            match Context::from_bytes(&bytes) {
                Ok(c) if c.id.to == set.digest() => {
                    self.contexts.insert(name.clone(), c);
                }
                Ok(_) => {
                    tracing::debug!(file = %name, "saved context is another version's; dropped")
                }
                Err(e) => tracing::warn!(file = %name, error = %e, "saved context dropped"),
            }
        }
    }

    /// In place and `previous`: saves the contexts (and removes those of
    /// files without one). Over an overlay they are rebuilt by applying it.
    fn save_contexts(&self) -> Result<()> {
        if !matches!(self.mode, StateMode::InPlace | StateMode::Previous) {
            return Ok(());
        }
        for name in self.sets.keys() {
            let p = Self::context_path(&self.dir, name);
            match self.contexts.get(name) {
                Some(c) => {
                    if let Some(parent) = p.parent() {
                        std::fs::create_dir_all(parent)
                            .map_err(|e| io_err("creating", parent, e))?;
                    }
                    write_atomic(&p, &c.to_bytes())?;
                }
                None => {
                    let _ = std::fs::remove_file(&p);
                }
            }
        }
        Ok(())
    }

    /// Applies one delta object to file `name`, with and then in place of
    /// its context.
    fn apply_one(&mut self, name: &str, bytes: &[u8]) -> Result<()> {
        let set = self
            .sets
            .get_mut(name)
            .ok_or_else(|| Error::NotFound(format!("publisher snapshot has no file `{name}`")))?;
        let (_, next) = apply_delta_ctx(set, bytes, self.contexts.get(name))?;
        match next {
            Some(c) => self.contexts.insert(name.to_string(), c),
            None => self.contexts.remove(name),
        };
        Ok(())
    }

    fn overlay_dir(dir: &Path, version: u64) -> PathBuf {
        dir.join("overlay").join(format!("{version:020}"))
    }

    /// How this snapshot follows the versions (`InPlace` or `Overlay`).
    pub fn mode(&self) -> StateMode {
        self.mode
    }

    /// How its files were checked when it was opened.
    pub fn check(&self) -> Check {
        self.check
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

    /// Loads the snapshot (trusted by its stamps, else verified in full; the
    /// overlay applied), resolving a pending commit with `committed` (asked
    /// of the bucket for the pending version and writer). `Ok(None)`: no
    /// trusted snapshot (a fresh start, or anything in doubt); the state
    /// read, if any, is returned for its numbering.
    pub async fn load<F, Fut>(
        dir: &Path,
        mode: StateMode,
        committed: F,
    ) -> (Option<Snapshot>, Option<State>)
    where
        F: FnOnce(u64, String) -> Fut,
        Fut: std::future::Future<Output = Result<Committed>>,
    {
        // The snapshot's size: its files, or an anchor's in `next/` when a
        // crash left its commit pending.
        let bytes = crate::fsio::dir_bytes(&Self::files_dir(dir))
            .max(crate::fsio::dir_bytes(&Self::next_dir(dir)));
        let mode = mode.resolve(dir, bytes);
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
                    let _ = std::fs::remove_dir_all(Self::overlay_dir(dir, p.version));
                }
                Err(e) => {
                    tracing::warn!(error = %e, "cannot resolve the pending commit; the next version will be an anchor");
                    return (None, Some(state));
                }
            }
        }
        let base = state.clone();
        match Self::open(dir, mode, state, target, false) {
            Ok(s) => {
                let recorded = s.state.clone();
                (Some(s), Some(recorded))
            }
            Err(e) if mode == StateMode::Previous && !base.base.is_empty() => {
                tracing::warn!(error = %e, "the checkpoint the last version was published from is gone or changed (--state-mode previous needs the trainer to keep each checkpoint, unchanged, until the next one is published); the next version will be an anchor");
                (None, Some(base))
            }
            Err(e) => {
                tracing::warn!(error = %e, "publisher snapshot does not verify; the next version will be an anchor");
                (None, Some(base))
            }
        }
    }

    /// The snapshot of `state` (a committed `target` brought in): its files
    /// trusted by stamp or (`full`, a commit in flight, any stamp differing)
    /// verified with one digest pass, the overlay applied, recorded.
    fn open(
        dir: &Path,
        mode: StateMode,
        state: State,
        target: Option<(State, VersionKind)>,
        full: bool,
    ) -> Result<Snapshot> {
        let mut state = state;
        let mut target = target;
        if let Some((after, VersionKind::Anchor)) = &target {
            // The commit happened: `next/` becomes the snapshot (unless the
            // swap already did).
            if Self::next_dir(dir).exists() {
                Self::swap_in_next(dir)?;
            }
            state = after.clone();
            state.overlay.clear();
            state.snapshot_files.clear();
            target = None;
            let _ = std::fs::remove_dir_all(dir.join("overlay"));
        }
        if mode == StateMode::Previous
            && let Some((after, VersionKind::Delta)) = &target
        {
            // The commit happened: the checkpoint it was made from holds the
            // version (its paths and stamps were recorded before the
            // commit). Its contexts are those saved for it, if the crash
            // came after they were written (they name the digests they lead
            // to); otherwise the next delta is made without one.
            state = after.clone();
            target = None;
            let _ = std::fs::remove_dir_all(dir.join("overlay"));
        }
        if state.disk_digests().is_empty() {
            return Err(Error::NotFound("the state lists no snapshot file".into()));
        }
        if !state.base.is_empty() && mode != StateMode::Previous {
            return Err(Error::Config(format!(
                "the state's last version is the trainer's checkpoint {} (--state-mode \
                 previous), not a snapshot of its own; another --state-mode starts from an anchor",
                state.base.values().next().expect("not empty").display()
            )));
        }
        if mode == StateMode::Previous && !state.overlay.is_empty() {
            return Err(Error::Config(
                "the state holds an overlay (--state-mode overlay); --state-mode previous \
                 starts from an anchor"
                    .into(),
            ));
        }
        let trusted = !full && target.is_none() && Self::stamps_hold(dir, &state);
        let mut sets = BTreeMap::new();
        for name in state.disk_digests().keys() {
            let path = state.file_path(dir, name);
            let digests = if trusted {
                Digests::Skip
            } else {
                Digests::Compute
            };
            let set = match mode {
                StateMode::InPlace => TensorSet::map(&path, true, digests)?,
                StateMode::Previous => TensorSet::map(&path, false, digests)?,
                _ => TensorSet::map_private(&path, digests)?,
            };
            sets.insert(name.clone(), set);
        }
        if trusted {
            for (name, set) in sets.iter_mut() {
                let digests = state.disk_digests()[name].parsed().ok_or_else(|| {
                    Error::metadata(
                        "state.json",
                        format!("`{name}`: digests are not 16 hex digits"),
                    )
                })?;
                set.assume_digests(&digests)?;
            }
        } else {
            let found: BTreeMap<String, FileDigests> = sets
                .iter()
                .map(|(n, s)| (n.clone(), FileDigests::of(s)))
                .collect();
            if found != *state.disk_digests() {
                match &target {
                    // A delta committed and applied in place before the crash.
                    Some((after, VersionKind::Delta)) if found == after.tensor_files => {
                        state = after.clone();
                        state.overlay.clear();
                        state.snapshot_files.clear();
                        target = None;
                    }
                    _ => {
                        return Err(Error::Integrity {
                            scope: "publisher snapshot".into(),
                            expected: "the digests in state.json".into(),
                            actual: "others".into(),
                        });
                    }
                }
            }
        }
        let mut snap = Snapshot {
            dir: dir.to_path_buf(),
            mode,
            check: if trusted { Check::Stamps } else { Check::Full },
            state,
            sets,
            contexts: BTreeMap::new(),
        };
        // The contexts of the files' own version (the overlay's replay
        // brings them forward).
        snap.load_contexts();
        // Over an overlay, every version patches private pages (at RL
        // densities, all of them): fault them in writable now, before a
        // diff maps them for reading (see `TensorSet::populate_private`).
        if matches!(snap.mode, StateMode::Overlay | StateMode::Auto) {
            for set in snap.sets.values_mut() {
                set.populate_private();
            }
        }
        // The overlay: the delta versions since the files' own.
        for ov in snap.state.overlay.clone() {
            snap.apply_overlay_version(&ov)?;
        }
        snap.check_digests(&snap.state.tensor_files, "state.json")?;
        if let Some((after, _)) = target
            && snap.state.version != after.version
        {
            // A committed delta not applied yet: its objects are in the
            // journal (or already moved to the overlay).
            let mut deltas = Vec::new();
            for name in snap.sets.keys() {
                let file = format!("{name}.delta");
                let journal = Self::journal_dir(dir, after.version).join(&file);
                let p = if journal.exists() {
                    journal
                } else {
                    Self::overlay_dir(dir, after.version).join(&file)
                };
                let delta = std::fs::read(&p).map_err(|e| io_err("reading", &p, e))?;
                deltas.push((name.clone(), delta));
            }
            snap.advance(&deltas, after)?;
        } else {
            if snap.mode == StateMode::InPlace && !snap.state.overlay.is_empty() {
                // In place now: the overlay was applied to the files; they
                // hold the version.
                snap.settle_in_place()?;
            } else if !trusted {
                snap.state.stamps = Self::take_stamps(dir, &snap.state, snap.sets.keys())?;
            }
            snap.record()?;
        }
        let _ = std::fs::remove_dir_all(dir.join("journal"));
        if !snap.state.base.is_empty() {
            // A snapshot of our own that a crash left behind.
            let _ = std::fs::remove_dir_all(Self::files_dir(dir));
        }
        if snap.state.overlay.is_empty() {
            let _ = std::fs::remove_dir_all(dir.join("overlay"));
        }
        Ok(snap)
    }

    /// `weightcast verify --state`: verifies the snapshot in full, whatever
    /// its stamps say — one digest pass over every file, each overlay object
    /// against its size and BLAKE3, the overlay applied (in private memory:
    /// nothing is written) and the result against the last version's
    /// digests. A snapshot that does not verify stops being trusted, in
    /// `state.json` too: the next version is an anchor. A commit left in
    /// flight is refused (a publish resolves it against the bucket).
    pub fn verify(dir: &Path) -> Result<Verified> {
        let Some(state) = Self::read_state(dir) else {
            return Err(Error::Config(format!(
                "{} holds no readable state.json: pass the --state of a publisher",
                dir.display()
            )));
        };
        if let Some(p) = &state.pending {
            return Err(Error::Conflict(format!(
                "{} has a commit of version {} in flight; run the publisher (`weightcast \
                 publish`, or the daemon) once to resolve it against the bucket, then verify",
                dir.display(),
                p.version
            )));
        }
        let mut report = Verified {
            version: state.version,
            files: state.disk_digests().len(),
            bytes: 0,
            overlay_versions: state.overlay.len(),
            ok: true,
            error: None,
        };
        let checked = (|| -> Result<u64> {
            let mut snap = Snapshot {
                dir: dir.to_path_buf(),
                mode: StateMode::Overlay,
                check: Check::Full,
                state: state.clone(),
                sets: BTreeMap::new(),
                contexts: BTreeMap::new(),
            };
            if state.disk_digests().is_empty() {
                return Err(Error::NotFound(
                    "the state lists no snapshot file (the next version is an anchor)".into(),
                ));
            }
            let mut bytes = 0;
            for (name, want) in state.disk_digests() {
                let path = state.file_path(dir, name);
                let set = TensorSet::map_private(&path, Digests::Compute)?;
                bytes += set.total_bytes();
                if FileDigests::of(&set) != *want {
                    return Err(Error::Integrity {
                        scope: format!("publisher snapshot {}", path.display()),
                        expected: "the digests in state.json".into(),
                        actual: "others".into(),
                    });
                }
                snap.sets.insert(name.clone(), set);
            }
            snap.load_contexts();
            for ov in &state.overlay {
                snap.apply_overlay_version(ov)?;
            }
            snap.check_digests(&state.tensor_files, "state.json")?;
            Ok(bytes)
        })();
        match checked {
            Ok(bytes) => report.bytes = bytes,
            Err(e) => {
                tracing::warn!(error = %e, "publisher snapshot does not verify; the next version will be an anchor");
                Self::distrust(dir, &state)?;
                report.ok = false;
                report.error = Some(e.to_string());
            }
        }
        Ok(report)
    }

    /// Whether every snapshot file the state lists still has its recorded
    /// stamp, taken before `state.json` was written.
    fn stamps_hold(dir: &Path, state: &State) -> bool {
        let record = Self::state_path(dir);
        let files = state.disk_digests();
        !state.stamps.is_empty()
            && state.stamps.len() == files.len()
            && files.keys().all(|name| {
                let path = state.file_path(dir, name);
                state.stamps.get(name).is_some_and(|want| {
                    Stamp::of(&path) == Some((want.size, want.stamp))
                        && want.stamp.older_than(&record)
                        && header_blake3(&path).as_deref() == Some(want.header_blake3.as_str())
                })
            })
    }

    /// The stamps of the snapshot files `names` as they are now (call once
    /// they are durable).
    pub(crate) fn take_stamps<'a>(
        dir: &Path,
        state: &State,
        names: impl Iterator<Item = &'a String>,
    ) -> Result<BTreeMap<String, FileStamp>> {
        let mut out = BTreeMap::new();
        for name in names {
            let path = state.file_path(dir, name);
            let missing = || io_err("reading", &path, std::io::ErrorKind::NotFound.into());
            let (size, stamp) = Stamp::of(&path).ok_or_else(missing)?;
            let header_blake3 = header_blake3(&path).ok_or_else(missing)?;
            out.insert(
                name.clone(),
                FileStamp {
                    size,
                    stamp,
                    header_blake3,
                },
            );
        }
        Ok(out)
    }

    /// Reads overlay version `ov`'s object for file `name`, checked against
    /// its recorded size and BLAKE3.
    fn read_object(dir: &Path, ov: &OverlayVersion, name: &str) -> Result<Vec<u8>> {
        let p = Self::overlay_dir(dir, ov.version).join(format!("{name}.delta"));
        let (size, blake3) = &ov.objects[name];
        let bytes = std::fs::read(&p).map_err(|e| io_err("reading", &p, e))?;
        let hash = crate::digest::blake3_of(&bytes).to_hex();
        if bytes.len() as u64 != *size || hash.as_str() != blake3 {
            return Err(Error::Integrity {
                scope: format!("publisher overlay object {}", p.display()),
                expected: format!("{size} bytes, BLAKE3 {blake3}"),
                actual: format!("{} bytes, BLAKE3 {hash}", bytes.len()),
            });
        }
        Ok(bytes)
    }

    /// Applies one overlay version's objects (checked against their
    /// recorded size and BLAKE3 first) to the sets.
    fn apply_overlay_version(&mut self, ov: &OverlayVersion) -> Result<()> {
        let odir = Self::overlay_dir(&self.dir, ov.version);
        if ov.objects.len() != self.sets.len() {
            return Err(Error::Integrity {
                scope: format!("publisher overlay {}", odir.display()),
                expected: format!("{} delta objects", self.sets.len()),
                actual: format!("{}", ov.objects.len()),
            });
        }
        for name in ov.objects.keys() {
            let bytes = Self::read_object(&self.dir, ov, name)?;
            self.apply_one(name, &bytes)?;
        }
        Ok(())
    }

    /// Checks the sets' digests against `want`.
    fn check_digests(&self, want: &BTreeMap<String, FileDigests>, what: &str) -> Result<()> {
        let found: BTreeMap<String, FileDigests> = self
            .sets
            .iter()
            .map(|(n, s)| (n.clone(), FileDigests::of(s)))
            .collect();
        if found != *want {
            return Err(Error::Integrity {
                scope: format!("publisher snapshot of version {}", self.state.version),
                expected: format!("the digests {what} records"),
                actual: "others".into(),
            });
        }
        Ok(())
    }

    /// In place: the files, patched, hold the version — flushed, stamped,
    /// and the overlay (if any) gone.
    fn settle_in_place(&mut self) -> Result<()> {
        for set in self.sets.values() {
            set.flush()?;
        }
        self.state.overlay.clear();
        self.state.snapshot_files.clear();
        self.state.stamps = Self::take_stamps(&self.dir, &self.state, self.sets.keys())?;
        self.save_contexts()
    }

    /// After a delta commit: applies its objects to the sets (verified: all
    /// or nothing per file) and records `after` — in place, the files
    /// flushed and stamped; over the overlay, the objects moved from the
    /// journal into it.
    fn advance(&mut self, deltas: &[(String, Vec<u8>)], after: State) -> Result<()> {
        for (name, bytes) in deltas {
            self.apply_one(name, bytes)?;
        }
        let mut after = after;
        after.pending = None;
        let version = after.version;
        match self.mode {
            StateMode::InPlace => {
                self.state = after;
                self.settle_in_place()?;
            }
            _ => {
                let disk = self.state.disk_digests().clone();
                let stamps = std::mem::take(&mut self.state.stamps);
                let mut overlay = std::mem::take(&mut self.state.overlay);
                let (journal, odir) = (
                    Self::journal_dir(&self.dir, version),
                    Self::overlay_dir(&self.dir, version),
                );
                if journal.exists() {
                    let parent = self.dir.join("overlay");
                    std::fs::create_dir_all(&parent).map_err(|e| io_err("creating", &parent, e))?;
                    let _ = std::fs::remove_dir_all(&odir);
                    std::fs::rename(&journal, &odir)
                        .map_err(|e| io_err("renaming", &journal, e))?;
                    sync_dir(&parent)?;
                }
                overlay.retain(|o| o.version < version);
                overlay.push(OverlayVersion::of(version, deltas));
                self.state = State {
                    overlay,
                    snapshot_files: disk,
                    stamps,
                    ..after
                };
            }
        }
        self.check_digests(&self.state.tensor_files.clone(), "the version")?;
        crate::failpoint::hit("publisher.before_record");
        self.record()?;
        let _ = std::fs::remove_dir_all(self.dir.join("journal"));
        Ok(())
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

    /// Writes `state.json` (no pending commit), later than the stamps it records.
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
        // `previous` mode needs none: after the commit the checkpoint holds
        // the version, and a crash resumes from it.
        let deltas = if self.mode == StateMode::Previous {
            &[]
        } else {
            deltas
        };
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
        let s = state.clone().without_snapshot();
        let _ = std::fs::remove_dir_all(dir.join("journal"));
        let _ = std::fs::remove_dir_all(dir.join("overlay"));
        let _ = std::fs::remove_dir_all(dir.join("context"));
        let _ = std::fs::remove_dir_all(Self::next_dir(dir));
        write_state(dir, &s)
    }

    /// Forgets a pending commit that did not happen (a lost race).
    pub fn abandon(&mut self) -> Result<()> {
        let _ = std::fs::remove_dir_all(self.dir.join("journal"));
        let _ = std::fs::remove_dir_all(Self::next_dir(&self.dir));
        self.record()
    }

    /// After a delta commit: applies the journal's deltas to the snapshot
    /// (in place, or over the overlay) and records the new state.
    pub fn finish_delta(&mut self, deltas: &[(String, Vec<u8>)], after: State) -> Result<()> {
        self.advance(deltas, after)
    }

    /// `previous` mode, after a delta commit: the checkpoint's own files
    /// (`sets`, mapped read-only, their digests those the diff computed)
    /// become the snapshot — nothing is applied, and nothing model-sized is
    /// written. The contexts move forward by decoding the deltas
    /// ([`Context::of_delta`]) and are saved (`context/<file>.ctx`, about
    /// 1.1 bytes per changed element), so that a new process starts from
    /// them; `after` (with the files' paths and stamps, taken before the
    /// commit) is recorded; a snapshot of our own left by an anchor is
    /// deleted.
    pub fn follow(
        &mut self,
        sets: BTreeMap<String, TensorSet>,
        deltas: &[(String, Vec<u8>)],
        after: State,
    ) -> Result<()> {
        let mut after = after;
        after.pending = None;
        let mut contexts = BTreeMap::new();
        for (name, bytes) in deltas {
            // The context the delta was made against (as the diff chose it).
            let before = self.sets.get(name).map(|s| s.digest());
            let old = self.contexts.get(name).filter(|c| Some(c.id.to) == before);
            match Context::of_delta(bytes, old) {
                Ok(Some(c)) => {
                    contexts.insert(name.clone(), c);
                }
                Ok(None) => {}
                Err(e) => {
                    tracing::warn!(file = %name, error = %e, "context dropped: the next delta of this file is made without one")
                }
            }
        }
        self.sets = sets;
        self.contexts = contexts;
        self.save_contexts()?;
        self.state = after;
        self.check_digests(&self.state.tensor_files.clone(), "the version")?;
        crate::failpoint::hit("publisher.before_record");
        self.record()?;
        let _ = std::fs::remove_dir_all(self.dir.join("journal"));
        // What an earlier binary's context chain left, and the anchor's
        // files if the base was still ours: no longer needed.
        let _ = std::fs::remove_dir_all(self.dir.join("overlay"));
        let _ = std::fs::remove_dir_all(Self::files_dir(&self.dir));
        Ok(())
    }

    /// `previous` mode: whether the checkpoint files the snapshot maps still
    /// have the stamps recorded when it was published (always, for a
    /// snapshot of our own). Checked before every publish reads them: the
    /// trainer may have rewritten or removed them since, and a mapped file
    /// cut shorter must not be read.
    pub fn base_holds(&self) -> bool {
        self.state.base.is_empty() || Self::stamps_hold(&self.dir, &self.state)
    }

    /// `previous` mode, a publish that found the same content as the last
    /// version (nothing committed): the new checkpoint's files, equal to the
    /// snapshot's, become its base, so the trainer may drop the older ones.
    pub fn rebase(
        &mut self,
        sets: BTreeMap<String, TensorSet>,
        base: BTreeMap<String, PathBuf>,
    ) -> Result<()> {
        let mut state = self.state.clone();
        state.base = base;
        state.stamps = Self::take_stamps(&self.dir, &state, sets.keys())?;
        self.sets = sets;
        self.state = state;
        self.record()?;
        let _ = std::fs::remove_dir_all(Self::files_dir(&self.dir));
        Ok(())
    }
}

/// BLAKE3 of a safetensors file's length and header bytes (`None`: not
/// readable as one).
fn header_blake3(path: &Path) -> Option<String> {
    use std::os::unix::fs::FileExt;
    let f = std::fs::File::open(path).ok()?;
    let mut len = [0u8; 8];
    f.read_exact_at(&mut len, 0).ok()?;
    let n = u64::from_le_bytes(len);
    if n > 100 << 20 {
        return None;
    }
    let mut head = vec![0u8; 8 + n as usize];
    f.read_exact_at(&mut head, 0).ok()?;
    Some(blake3::hash(&head).to_hex().to_string())
}

/// Writes `state.json` atomically, later than every stamp it records
/// ([`write_atomic_after`]).
pub(crate) fn write_state(dir: &Path, state: &State) -> Result<()> {
    let body = serde_json::to_vec_pretty(state).expect("state serializes");
    let newest = state.stamps.values().map(|s| s.stamp.ctime_ns).max();
    write_atomic_after(&Snapshot::state_path(dir), &body, newest.unwrap_or(0))
}

/// After an anchor commit: swaps `next/` in as the snapshot and loads it
/// (digests known, no pass over the data), its files stamped (they were
/// fsynced when written).
pub fn install_anchor(dir: &Path, mode: StateMode, after: State) -> Result<Snapshot> {
    let mode = mode.resolve(dir, crate::fsio::dir_bytes(&Snapshot::next_dir(dir)));
    Snapshot::swap_in_next(dir)?;
    let _ = std::fs::remove_dir_all(dir.join("overlay"));
    let _ = std::fs::remove_dir_all(dir.join("context"));
    let mut sets = BTreeMap::new();
    for (name, d) in &after.tensor_files {
        let path = Snapshot::files_dir(dir).join(name);
        let mut set = match mode {
            StateMode::InPlace => TensorSet::map(&path, true, Digests::Skip)?,
            StateMode::Previous => TensorSet::map(&path, false, Digests::Skip)?,
            _ => TensorSet::map_private(&path, Digests::Skip)?,
        };
        let digests = d.parsed().ok_or_else(|| {
            Error::metadata(
                "state.json",
                format!("`{name}`: digests are not 16 hex digits"),
            )
        })?;
        set.assume_digests(&digests)?;
        if matches!(mode, StateMode::Overlay | StateMode::Auto) {
            set.populate_private();
        }
        sets.insert(name.clone(), set);
    }
    let mut state = after;
    state.pending = None;
    state.overlay.clear();
    state.snapshot_files.clear();
    state.base.clear();
    state.stamps = Snapshot::take_stamps(dir, &state, sets.keys())?;
    let snap = Snapshot {
        dir: dir.to_path_buf(),
        mode,
        check: Check::Written,
        state,
        sets,
        contexts: BTreeMap::new(),
    };
    crate::failpoint::hit("publisher.before_record");
    snap.record()?;
    Ok(snap)
}

/// `previous` mode, after an anchor commit made from the checkpoint's own
/// files: they are the snapshot (`sets`, digests computed; `after` names
/// their paths and stamps). Nothing is written but `state.json`; what a
/// former mode or anchor left in the state directory goes.
pub fn install_base(
    dir: &Path,
    sets: BTreeMap<String, TensorSet>,
    after: State,
) -> Result<Snapshot> {
    for sub in ["overlay", "context", "journal", "snapshot", "next"] {
        let _ = std::fs::remove_dir_all(dir.join(sub));
    }
    let mut state = after;
    state.pending = None;
    state.overlay.clear();
    state.snapshot_files.clear();
    let snap = Snapshot {
        dir: dir.to_path_buf(),
        mode: StateMode::Previous,
        check: Check::Written,
        state,
        sets,
        contexts: BTreeMap::new(),
    };
    snap.check_digests(&snap.state.tensor_files, "the anchor")?;
    crate::failpoint::hit("publisher.before_record");
    snap.record()?;
    Ok(snap)
}

#[cfg(test)]
mod tests {
    use super::StateMode::{self, Auto, InPlace, Overlay};

    #[test]
    fn auto_keeps_an_overlay_only_where_memory_can_hold_it() {
        const GB: u64 = 1 << 30;
        let r = |m: StateMode, in_memory, snapshot, available| {
            m.resolve_with(in_memory, snapshot, available)
        };
        // In memory (tmpfs): in place, whatever the sizes.
        assert_eq!(r(Auto, true, 100 * GB, Some(GB)), InPlace);
        // On a disk: the overlay while the snapshot is at most a quarter of
        // the memory available ...
        assert_eq!(r(Auto, false, 2 * GB, Some(20 * GB)), Overlay);
        assert_eq!(r(Auto, false, 5 * GB, Some(20 * GB)), Overlay);
        // ... in place beyond (a model the overlay would hold in anonymous
        // memory the node cannot spare) ...
        assert_eq!(r(Auto, false, 5 * GB + 1, Some(20 * GB)), InPlace);
        assert_eq!(r(Auto, false, 8 * GB, Some(20 * GB)), InPlace);
        // ... and the overlay where the kernel does not say.
        assert_eq!(r(Auto, false, 100 * GB, None), Overlay);
        // An explicit mode is kept.
        assert_eq!(r(Overlay, false, 100 * GB, Some(GB)), Overlay);
        assert_eq!(r(Overlay, true, GB, Some(100 * GB)), Overlay);
        assert_eq!(r(InPlace, false, GB, Some(100 * GB)), InPlace);
    }
}
