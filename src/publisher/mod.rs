//! The publisher: turns checkpoints into committed versions.
//!
//! [`Publisher::publish`] takes a [`Checkpoint`] — opened from disk (one
//! `.safetensors` file, or a Hugging Face directory of shards, index, config
//! and tokenizer files, subdirectories and links included) or handed over from
//! memory — and commits it as the next version: an anchor (every safetensors
//! file in full) or a delta (per safetensors file, only the changed elements),
//! plus every non-tensor file that is new or changed.
//!
//! The cost of a delta version is one read of the checkpoint (memory-mapped,
//! compared against the memory-mapped snapshot of the last committed version)
//! plus the changes: the snapshot is updated in place from the version's own
//! delta objects (see [`state`]). An anchor writes the new snapshot once and
//! uploads its objects from it in parallel parts.
//!
//! The publisher keeps its numbering and its snapshot honest against the
//! bucket: before each version it checks that its last commit is still the
//! bucket's newest (a bucket wiped or reset, or another writer's commit,
//! makes the next version an anchor numbered after everything the bucket and
//! the state have seen), and a commit lost to another writer is followed by a
//! resync and one retry as an anchor.

mod changes;
pub mod checkpoint;
pub mod dist;
mod gate;
pub mod state;
mod trl;

use std::collections::BTreeMap;
use std::path::Path;

use bytes::Bytes;
use serde::Serialize;

use crate::codec::{DeltaOptions, anchor_prefix, encode_delta_ctx};
use crate::error::{Error, Result};
use crate::format::Encoding;
use crate::protocol::{
    Commit, Latest, Manifest, ObjectRole, Staging, VersionKind, commit, newest_version,
    read_manifest, write_latest,
};
use crate::store::{ConditionalWrites, Source, Store};

pub use changes::{ChangedTensor, Changes, ChangesOutcome};
pub use checkpoint::{
    Checkpoint, CheckpointOptions, DEFAULT_EXCLUDES, FileSource, SINGLE_FILE_NAME,
};
pub use dist::{DEFAULT_RANK_TIMEOUT, Distributed};
pub use gate::CommitGate;
pub use state::StateMode;
use state::{Committed, FileDigests, Snapshot, State};

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

/// How anchor objects are stored.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AnchorEncoding {
    /// Byte planes + zstd in independent chunks (docs/format.md §5.1):
    /// about 1.5x smaller on bf16 weights, decoded to the same bytes.
    #[default]
    Planes,
    /// The tensors as they are (a loadable safetensors file).
    Raw,
}

impl std::str::FromStr for AnchorEncoding {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "planes" => Ok(AnchorEncoding::Planes),
            "raw" => Ok(AnchorEncoding::Raw),
            other => Err(Error::Config(format!(
                "anchor encoding `{other}`: expected planes or raw"
            ))),
        }
    }
}

/// Publisher settings.
#[derive(Clone, Debug)]
pub struct PublisherConfig {
    /// Where the snapshot and `state.json` live.
    pub state_dir: std::path::PathBuf,
    /// Delta encoding.
    pub encoding: Encoding,
    /// With `compact2`: the largest share of changed words a file's delta is
    /// written in it; a denser one is written in `compact`
    /// ([`DeltaOptions::compact2_max_density`]; default 0.10).
    pub compact2_max_density: f64,
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
    /// Which files of a checkpoint directory are published
    /// ([`Publisher::publish_path`] and the daemon).
    pub checkpoint: CheckpointOptions,
    /// How anchor objects are stored (weightcast layout).
    pub anchor_encoding: AnchorEncoding,
    /// The bucket layout written.
    pub layout: crate::protocol::Layout,
    /// TRL's generation and index encoding, for `trl`-encoded deltas and the
    /// TRL layout.
    pub trl: crate::format::TrlOptions,
    /// Distributed publish: this publisher is one of W trainer ranks, each
    /// publishing its own shard files, and the W ranks commit one version per
    /// step together ([`dist`]). `None`: it publishes alone.
    pub distributed: Option<Distributed>,
    /// How the snapshot in `state_dir` follows the versions: patched in
    /// place, or kept as the last anchor wrote it with the deltas since
    /// beside it (an overlay); by default in place on tmpfs and ramfs and
    /// for a snapshot of more than a quarter of the memory available, an
    /// overlay elsewhere ([`StateMode::resolve`]).
    pub state_mode: StateMode,
}

impl PublisherConfig {
    /// Defaults with the snapshot in `state_dir`: `compact` deltas, an anchor
    /// every 10 versions (`planes`-compressed), the weightcast layout, no
    /// notifications, no automatic retention, checkpoint directories read
    /// with the default excludes.
    pub fn new(state_dir: impl Into<std::path::PathBuf>) -> PublisherConfig {
        PublisherConfig {
            state_dir: state_dir.into(),
            encoding: Encoding::Compact,
            compact2_max_density: crate::codec::COMPACT2_MAX_DENSITY,
            anchors: AnchorPolicy::default(),
            single_writer: false,
            notify_urls: Vec::new(),
            notify_key: None,
            retention: None,
            checkpoint: CheckpointOptions::default(),
            anchor_encoding: AnchorEncoding::default(),
            layout: crate::protocol::Layout::default(),
            trl: crate::format::TrlOptions::default(),
            distributed: None,
            state_mode: StateMode::Auto,
        }
    }
}

/// Per-publish options.
#[derive(Clone, Debug, Default)]
pub struct PublishOptions {
    /// The trainer's step. When given it must be newer than the step of the
    /// last committed version (else [`Error::Conflict`]); it is recorded in
    /// the manifest. Required when the publisher is one of several ranks
    /// ([`PublisherConfig::distributed`]): every rank publishes the same step
    /// as one version.
    pub step: Option<u64>,
}

/// What one publish did (the CLI prints it as one JSON line).
#[derive(Clone, Debug, Serialize)]
pub struct Published {
    /// The committed version (for an unchanged checkpoint: the last one).
    pub version: u64,
    /// `anchor` or `delta`.
    pub kind: VersionKind,
    /// Bytes written to the bucket for this version (objects and manifest).
    pub bytes: u64,
    /// Changed elements (anchors: all).
    pub changed: u64,
    /// Elements of the checkpoint.
    pub total: u64,
    /// The trainer step recorded with the version.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub step: Option<u64>,
    /// True when the checkpoint was identical to the last version: nothing
    /// was written and `version` is that version.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub unchanged: bool,
    /// Why an anchor was written, when it was.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub anchor_reason: Option<String>,
    /// Bytes of an anchor's bridge deltas (included in `bytes`).
    #[serde(skip_serializing_if = "is_zero")]
    pub bridge_bytes: u64,
    /// Subscribers that acknowledged this version's notification; absent
    /// while it is still being sent in the background (the fan-out never
    /// delays the publish: see [`Publisher::notifications_settled`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub notified: Option<usize>,
    /// What automatic retention removed after this version, when it ran.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub collected: Option<crate::protocol::Collected>,
    /// Egress: bytes this publish sent to the store (the version's objects,
    /// its manifest and the `latest.json` hint).
    pub egress_bytes: u64,
    /// Fan-out per subscriber: bytes a subscriber that holds the previous
    /// version downloads for this one (its manifest, deltas or an anchor's
    /// bridges, changed files; a whole anchor when it has no bridges). The
    /// fleet downloads this times its subscribers (or per region, behind
    /// relays).
    pub fanout_bytes: u64,
    /// Fan-out: the subscribers this version's notification went to
    /// (registered ones and `--notify` URLs); absent while it is still being
    /// sent in the background, as `notified`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fanout_subscribers: Option<usize>,
    /// Bytes this publish caused to be written to local storage: the state
    /// directory's journal, overlay and snapshot, pages of files it dirtied
    /// (`write_bytes` of `/proc/self/io`; 0 on tmpfs, absent where the kernel
    /// does not say). A `file://` bucket on a disk counts here too.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub local_write_bytes: Option<u64>,
    /// Seconds spent finding and encoding this version's changes: the diff
    /// of the checkpoint against the snapshot, or the encoding of changes
    /// the caller found ([`Publisher::publish_changes`]); absent where no
    /// delta was made.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub diff_s: Option<f64>,
}

/// A delta version's objects and what its state records.
struct DeltaParts {
    /// Per tensor file, its delta object.
    deltas: Vec<(String, Vec<u8>)>,
    /// Changed elements.
    changed: u64,
    /// All elements.
    total: u64,
    /// Per tensor file, its tensors' digests after the version.
    tensor_files: BTreeMap<String, FileDigests>,
}

/// Bytes of the `latest.json` hint written at a commit.
fn latest_bytes(version: u64, anchor_version: u64) -> u64 {
    serde_json::to_vec(&Latest {
        version,
        anchor_version,
    })
    .map_or(0, |b| b.len() as u64)
}

impl Published {
    /// Nothing written: the last committed version `st` answers.
    fn unchanged(st: &State, total: u64) -> Published {
        Published {
            version: st.version,
            kind: if st.anchor_version == st.version {
                VersionKind::Anchor
            } else {
                VersionKind::Delta
            },
            bytes: 0,
            changed: 0,
            total,
            step: st.step,
            unchanged: true,
            anchor_reason: None,
            bridge_bytes: 0,
            notified: Some(0),
            collected: None,
            egress_bytes: 0,
            fanout_bytes: 0,
            fanout_subscribers: Some(0),
            local_write_bytes: None,
            diff_s: None,
        }
    }
}

fn is_zero(v: &u64) -> bool {
    *v == 0
}

/// What the publisher knows of the bucket before a version.
struct Position {
    /// The last version the state or the bucket has seen (the next is one more).
    last: Option<u64>,
    /// The step of the newest committed version, when recorded.
    last_step: Option<u64>,
}

/// Publishes checkpoints to one store prefix.
pub struct Publisher {
    store: Store,
    cfg: PublisherConfig,
    /// The trusted snapshot of the bucket's newest version, if any.
    snapshot: Option<Snapshot>,
    /// The last state read (numbering, even when the snapshot is not trusted).
    state: Option<State>,
    /// Notifications being sent in the background (each: how many
    /// subscribers acknowledged, and how many it went to).
    notifications: tokio::task::JoinSet<(usize, usize)>,
    /// Subscribers the last notification that finished went to.
    last_fanout: usize,
    /// Stops publishes before their commit (graceful shutdown).
    gate: std::sync::Arc<CommitGate>,
}

impl Publisher {
    /// Opens a publisher: probes the store's conditional writes (refusing a
    /// store that ignores them unless `single_writer`), loads and verifies the
    /// snapshot, resolving a commit that was in flight when the previous
    /// process stopped.
    pub async fn open(store: Store, cfg: PublisherConfig) -> Result<Publisher> {
        if !matches!(
            cfg.encoding,
            Encoding::Compact | Encoding::Compact2 | Encoding::Trl
        ) {
            return Err(Error::Config(format!(
                "delta encoding `{}`: expected compact, compact2 or trl (`full` and `planes` are anchor \
                 encodings: --anchor-encoding)",
                cfg.encoding
            )));
        }
        if !(0.0..=1.0).contains(&cfg.compact2_max_density) {
            return Err(Error::Config(format!(
                "compact2_max_density {}: expected a share from 0 to 1 (--compact2-max-density)",
                cfg.compact2_max_density
            )));
        }
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
        if cfg.distributed.is_some() && cfg.layout == crate::protocol::Layout::Trl {
            return Err(Error::Config(
                "a distributed publish (--world 2 or more) needs the weightcast layout: TRL's \
                 layout has no commit manifests to join the ranks' shards in"
                    .into(),
            ));
        }
        std::fs::create_dir_all(&cfg.state_dir)
            .map_err(|e| Error::io(format!("creating {}", cfg.state_dir.display()), e))?;
        let s = store.clone();
        let layout = cfg.layout;
        let (snapshot, state) = Snapshot::load(
            &cfg.state_dir,
            cfg.state_mode,
            |version, writer| async move {
                let ours = match layout {
                    crate::protocol::Layout::Weightcast => read_manifest(&s, version)
                        .await?
                        .is_some_and(|m| m.writer == writer),
                    crate::protocol::Layout::Trl => {
                        crate::protocol::trl::token_present(&s, &writer).await?
                    }
                };
                Ok(if ours {
                    Committed::Ours
                } else {
                    Committed::NotOurs
                })
            },
        )
        .await;
        Ok(Publisher {
            store,
            cfg,
            snapshot,
            state,
            notifications: tokio::task::JoinSet::new(),
            last_fanout: 0,
            gate: Default::default(),
        })
    }

    /// Its trusted snapshot, if any: how its files were checked
    /// ([`state::Check`]) and how it follows the versions ([`StateMode`]).
    pub fn snapshot(&self) -> Option<(state::Check, StateMode)> {
        self.snapshot.as_ref().map(|s| (s.check(), s.mode()))
    }

    /// The last committed version this publisher knows of, if any.
    pub fn version(&self) -> Option<u64> {
        self.state.as_ref().map(|s| s.version)
    }

    /// How it reads checkpoint directories.
    pub fn checkpoint_options(&self) -> &CheckpointOptions {
        &self.cfg.checkpoint
    }

    /// The store it publishes to.
    pub fn store(&self) -> &Store {
        &self.store
    }

    /// Opens the checkpoint at `path` with the configured filters and
    /// publishes it.
    pub async fn publish_path(&mut self, path: &Path, opts: &PublishOptions) -> Result<Published> {
        let cp = Checkpoint::open(path, &self.cfg.checkpoint)?;
        self.publish(cp, opts).await
    }

    /// The gate that stops this publisher's publishes before their commit.
    pub fn commit_gate(&self) -> std::sync::Arc<CommitGate> {
        self.gate.clone()
    }

    /// Notifications still being sent in the background.
    pub fn notifications_in_flight(&self) -> usize {
        self.notifications.len()
    }

    /// Publishes `cp` as the next version.
    pub async fn publish(&mut self, cp: Checkpoint, opts: &PublishOptions) -> Result<Published> {
        let written = crate::fsio::written_bytes();
        let mut p = self.publish_counted(cp, opts).await?;
        p.local_write_bytes = written
            .zip(crate::fsio::written_bytes())
            .map(|(a, b)| b.saturating_sub(a));
        Ok(p)
    }

    async fn publish_counted(
        &mut self,
        cp: Checkpoint,
        opts: &PublishOptions,
    ) -> Result<Published> {
        self.gate.begin_publish()?;
        if self.cfg.state_mode == StateMode::Previous
            && (self.cfg.layout == crate::protocol::Layout::Trl || cp.tensor_paths().is_none())
        {
            return Err(previous_needs_files());
        }
        if self.cfg.layout == crate::protocol::Layout::Trl {
            return self.publish_trl(cp, opts).await;
        }
        let mut cp = cp;
        if self.cfg.distributed.is_none() {
            cp.name_single_file();
        }
        if self.cfg.distributed.is_some() && opts.step.is_none() {
            return Err(Error::BadRequest(
                "a distributed publish (--world 2 or more) needs the trainer's step (--step, or \
                 \"step\" in the request): every rank publishes the same step as one version"
                    .into(),
            ));
        }
        let pos = self.position().await?;
        if let Some(done) = self.already_committed(&pos, opts, &cp)? {
            return Ok(done);
        }
        pos.check_step(opts)?;
        let next = pos.next()?;
        match self.publish_at(&mut cp, next, opts).await {
            Err(Error::Conflict(why))
                if why.starts_with(LOST_RACE) && self.cfg.distributed.is_none() =>
            {
                // Another writer took the version: resync and try once more,
                // as an anchor after the bucket's newest version.
                tracing::warn!(version = next, "lost the commit race; resyncing");
                // Nothing was committed: the retry may be stopped again.
                self.gate.begin_publish()?;
                self.snapshot = None;
                let pos = self.position().await?;
                let next = pos.next()?;
                self.publish_at(&mut cp, next, opts).await
            }
            other => other,
        }
    }

    /// Checks the state against the bucket and says where the next version
    /// goes. A snapshot that is not the bucket's newest version (a wiped or
    /// reset bucket, another writer's commit) stops being trusted.
    async fn position(&mut self) -> Result<Position> {
        if let Some(snap) = &self.snapshot
            && !snap.base_holds()
        {
            // `previous` mode: the trainer rewrote or removed the checkpoint
            // the last version was published from. Its mapping is dropped
            // unread.
            tracing::warn!(
                checkpoint = %snap.state.base.values().next().map(|p| p.display().to_string()).unwrap_or_default(),
                "the checkpoint the last version was published from changed or is gone \
                 (--state-mode previous needs the trainer to keep each checkpoint, unchanged, \
                 until the next one is published: a directory per step); the next version \
                 will be an anchor"
            );
            self.snapshot = None;
        }
        let newest = newest_version(&self.store).await?;
        // A state records a commit only with its writer token (a state
        // written before any commit has none).
        let recorded = self
            .state
            .as_ref()
            .filter(|s| !s.writer.is_empty())
            .map(|s| s.version);
        if let Some(snap) = &self.snapshot {
            let v = snap.state.version;
            let ours = match newest {
                Some(n) if n == v => readable_manifest(&self.store, v)
                    .await?
                    .is_some_and(|m| m.writer == snap.state.writer),
                _ => false,
            };
            if ours {
                return Ok(Position {
                    last: Some(v),
                    last_step: snap.state.step,
                });
            }
            tracing::warn!(
                snapshot = v,
                bucket = ?newest,
                "the bucket's newest version is not this publisher's last commit; the next version will be an anchor"
            );
            self.snapshot = None;
        }
        let last = match (newest, recorded) {
            // Ranks number from the bucket alone, so that they all agree.
            _ if self.cfg.distributed.is_some() => newest,
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        };
        let last_step = match newest {
            Some(n) => readable_manifest(&self.store, n)
                .await?
                .and_then(|m| m.step),
            None => None,
        };
        Ok(Position { last, last_step })
    }

    async fn publish_at(
        &mut self,
        cp: &mut Checkpoint,
        next: u64,
        opts: &PublishOptions,
    ) -> Result<Published> {
        let total = cp.total_elements();
        let mut anchor_reason = self.anchor_reason(cp, next);

        // Deltas against the snapshot whenever the files are the same: this
        // version's deltas, or an anchor's bridges. All are encoded before
        // anything is uploaded, so a tensor whose structure changed turns the
        // version into an anchor without bridges.
        let mut deltas: Vec<(String, Vec<u8>)> = Vec::new();
        let mut changed = 0u64;
        let diff_started = std::time::Instant::now();
        let mut diff_s = None;
        if let Some(snap) = &self.snapshot
            && same_files(snap, cp)
        {
            let mut structure = None;
            for (name, set) in cp.tensors.iter_mut() {
                let opts = DeltaOptions {
                    encoding: self.cfg.encoding,
                    model_version: next,
                    base_version: next - 1,
                    trl: self.cfg.trl,
                    compact2_max_density: self.cfg.compact2_max_density,
                };
                // The context the snapshot holds for the file, when it leads
                // to the file's state (`compact2`; other encodings ignore it).
                let base = &snap.sets[name];
                let context = snap.contexts.get(name).filter(|c| c.id.to == base.digest());
                match encode_delta_ctx(base, set, &opts, context) {
                    Ok((d, s, _)) => {
                        changed += s.changed;
                        deltas.push((name.clone(), d));
                    }
                    Err(Error::StructureChanged(why)) => {
                        structure = Some(format!("{name}: {why}"));
                        break;
                    }
                    Err(e) => return Err(e.in_input(format!("checkpoint {}", cp.describe()))),
                }
            }
            let st = &snap.state;
            diff_s = Some(diff_started.elapsed().as_secs_f64());
            let delta_bytes: u64 = deltas.iter().map(|d| d.1.len() as u64).sum();
            if let Some(why) = structure {
                deltas.clear();
                anchor_reason = Some(why);
            } else if changed == 0 && self.cfg.distributed.is_none() && self.files_unchanged(cp)? {
                // The same content as the last version: nothing to publish.
                cp.check_unchanged()?;
                let unchanged = Published::unchanged(st, total);
                if self.cfg.state_mode == StateMode::Previous
                    && let Some(paths) = cp.tensor_paths().cloned()
                    && let Some(snap) = self.snapshot.as_mut()
                {
                    // Its files become the base (the trainer may drop the
                    // older ones).
                    snap.rebase(std::mem::take(&mut cp.tensors), paths)?;
                    let recorded = snap.state.clone();
                    if let Err(e) = cp.check_unchanged() {
                        // Rewritten around the stamps just recorded.
                        self.distrust_snapshot(&recorded);
                        return Err(e);
                    }
                }
                return Ok(unchanged);
            } else if let Some((why, bridge)) = self.size_reason(st, delta_bytes) {
                if !bridge {
                    deltas.clear();
                    anchor_reason = Some(why);
                } else if anchor_reason.is_none() {
                    anchor_reason = Some(why);
                }
            }
        }
        // Several ranks: they agree on the kind (an anchor if any of them
        // needs one; this rank's deltas are then its bridges) and the writer.
        let mut writer = None;
        let mut staged = dist::Staged::default();
        if let Some(d) = &self.cfg.distributed {
            let step = opts.step.expect("checked in publish");
            let agreed = dist::agree(&self.store, d, next, step, anchor_reason.clone()).await?;
            if anchor_reason.is_none() {
                anchor_reason = agreed.anchor;
            }
            if agreed.resumed {
                // A restart: its earlier part may name objects of this writer.
                staged = dist::staged(&self.store, d, next, &agreed.writer).await?;
            }
            writer = Some(agreed.writer);
        }
        let staging = match writer {
            Some(w) => Staging::with_writer(next, w),
            None => Staging::new(next),
        };
        let out = match anchor_reason {
            Some(reason) => {
                self.publish_anchor(cp, staging, reason, deltas, opts, &staged)
                    .await
            }
            None => {
                let tensor_files = cp
                    .tensors
                    .iter()
                    .map(|(n, s)| (n.clone(), FileDigests::of(s)))
                    .collect();
                let parts = DeltaParts {
                    deltas,
                    changed,
                    total: cp.total_elements(),
                    tensor_files,
                };
                self.publish_delta(cp, staging, parts, opts, &staged).await
            }
        };
        out.map(|p| Published { diff_s, ..p })
    }

    /// A distributed rank restarted after the version of its step was
    /// committed (with its part): that version, as an unchanged publish —
    /// if the checkpoint is the one committed. A rank's content is part of
    /// its identity: other content for a committed step is refused, as a
    /// publisher alone refuses a step that is not newer.
    fn already_committed(
        &self,
        pos: &Position,
        opts: &PublishOptions,
        cp: &Checkpoint,
    ) -> Result<Option<Published>> {
        let Some(snap) = self.snapshot.as_ref() else {
            return Ok(None);
        };
        let st = &snap.state;
        let Some(d) = &self.cfg.distributed else {
            return Ok(None);
        };
        if opts.step.is_none() || st.step != opts.step || pos.last != Some(st.version) {
            return Ok(None);
        }
        if let Some(diff) = self.content_differs(snap, cp)? {
            return Err(Error::Conflict(format!(
                "rank {} of {}: step {} is already committed as version {}, and this \
                 checkpoint is not what this rank committed for it ({diff}); new content for a \
                 committed step is refused, as for a publisher alone (steps must increase). \
                 Publish it as a newer --step on every rank",
                d.rank,
                d.world,
                opts.step.unwrap_or_default(),
                st.version
            )));
        }
        let total = snap.sets.values().map(|s| s.total_elements()).sum();
        Ok(Some(Published::unchanged(st, total)))
    }

    /// What differs between the snapshot and `cp` (`None`: the same tensor
    /// files, tensors and bytes, and the same non-tensor files). Compares the
    /// bytes, not digests: one read of the checkpoint, on a restart only.
    fn content_differs(&self, snap: &Snapshot, cp: &Checkpoint) -> Result<Option<String>> {
        if !same_files(snap, cp) {
            return Ok(Some("its set of safetensors files differs".into()));
        }
        for (name, set) in &cp.tensors {
            let held = &snap.sets[name];
            if let Err(e) = held.same_structure(set) {
                return Ok(Some(format!("`{name}`: {e}")));
            }
            for (i, t) in set.tensors().iter().enumerate() {
                let j = held.position(&t.name).unwrap_or(i);
                if held.data(j) != set.data(i) {
                    return Ok(Some(format!("tensor `{}` in `{name}` differs", t.name)));
                }
            }
        }
        if !self.files_unchanged(cp)? {
            return Ok(Some("its non-tensor files differ".into()));
        }
        Ok(None)
    }

    fn anchor_reason(&self, cp: &Checkpoint, next: u64) -> Option<String> {
        let Some(snap) = &self.snapshot else {
            return Some(
                "no trusted snapshot (first version, or the snapshot or the bucket changed)".into(),
            );
        };
        if next - snap.state.anchor_version >= self.cfg.anchors.every {
            return Some(format!("every {} versions", self.cfg.anchors.every));
        }
        if !same_files(snap, cp) {
            return Some("the set of safetensors files changed".into());
        }
        // The version's safetensors files are the union of every rank's: a
        // rank that left (or joined) changes them though no rank's own did.
        let world = self.cfg.distributed.as_ref().map(|d| d.world);
        if snap.state.world != world {
            let n = |w: Option<u32>| w.map_or("1 (alone)".to_string(), |w| w.to_string());
            return Some(format!(
                "the number of ranks changed from {} to {}, so the set of safetensors files may \
                 have",
                n(snap.state.world),
                n(world)
            ));
        }
        None
    }

    /// Why deltas of `delta_bytes` after `st` make the version an anchor, by
    /// size; with whether they are still kept as its bridges.
    fn size_reason(&self, st: &State, delta_bytes: u64) -> Option<(String, bool)> {
        let anchor = st.anchor_bytes.max(1) as f64;
        if delta_bytes as f64 > self.cfg.anchors.max_delta_fraction * anchor {
            // Nearly the model: not worth keeping even as a bridge.
            return Some((
                format!(
                    "delta would be {:.0}% of an anchor",
                    100.0 * delta_bytes as f64 / anchor
                ),
                false,
            ));
        }
        ((st.bytes_since_anchor + delta_bytes) as f64
            > self.cfg.anchors.max_replay_fraction * anchor)
            .then(|| {
                (
                    "a newcomer's replay since the last anchor would exceed the limit".into(),
                    true,
                )
            })
    }

    /// Whether every non-tensor file is the same as in the last version.
    fn files_unchanged(&self, cp: &Checkpoint) -> Result<bool> {
        let Some(snap) = &self.snapshot else {
            return Ok(false);
        };
        if cp.files.len() != snap.state.files.len() {
            return Ok(false);
        }
        for (name, src) in &cp.files {
            if snap.state.files.get(name) != Some(&checkpoint::hash_file(src)?) {
                return Ok(false);
            }
        }
        Ok(true)
    }

    async fn publish_delta(
        &mut self,
        cp: &mut Checkpoint,
        mut staging: Staging,
        parts: DeltaParts,
        opts: &PublishOptions,
        staged: &dist::Staged,
    ) -> Result<Published> {
        let DeltaParts {
            deltas,
            changed,
            total,
            tensor_files,
        } = parts;
        let next = staging.version();
        let snap = self.snapshot.as_ref().expect("a delta implies a snapshot");
        let base = snap.state.clone();
        let mut bytes = 0u64;
        for (name, d) in &deltas {
            let key = staging.key(ObjectRole::Delta, name)?;
            staged.check(
                &key,
                d.len() as u64,
                crate::digest::blake3_of(d).to_hex().as_str(),
            )?;
        }
        for (name, d) in &deltas {
            bytes += d.len() as u64;
            staging
                .upload(&self.store, name, ObjectRole::Delta, Bytes::from(d.clone()))
                .await?;
            crate::failpoint::hit("publisher.mid_upload");
        }
        let files = self
            .upload_files(cp, &mut staging, &base.files, staged)
            .await?;
        bytes += files.1;
        cp.check_unchanged()?;
        let writer = staging.writer().to_string();
        let manifest = staging.manifest(
            VersionKind::Delta,
            Some(next - 1),
            base.anchor_version,
            opts.step,
        );
        let manifest_bytes = manifest_size(&manifest);
        let after = State {
            version: next,
            writer: writer.clone(),
            anchor_version: base.anchor_version,
            anchor_bytes: base.anchor_bytes,
            bytes_since_anchor: base.bytes_since_anchor + bytes + manifest_bytes,
            step: opts.step,
            world: self.cfg.distributed.as_ref().map(|d| d.world),
            files: files.0,
            tensor_files,
            overlay: Vec::new(),
            snapshot_files: BTreeMap::new(),
            stamps: BTreeMap::new(),
            base: BTreeMap::new(),
            pending: None,
        };
        let previous = self.cfg.state_mode == StateMode::Previous;
        let mut after = after;
        if previous {
            // The checkpoint's own files become the next delta's base: their
            // paths and stamps go into the state before the commit (a crash
            // after it resumes from them), taken once the publish has read
            // them — and checked against the stamps the reads began with.
            after.base = cp.tensor_paths().cloned().unwrap_or_default();
            after.stamps = Snapshot::take_stamps(&self.cfg.state_dir, &after, cp.tensors.keys())?;
            cp.check_unchanged()?;
        }
        let snap = self.snapshot.as_mut().expect("checked above");
        snap.prepare_delta(next, &writer, &deltas, after.clone())?;
        crate::failpoint::hit("publisher.before_commit");
        if let Err(e) = self.commit(&manifest, cp).await {
            if let Some(s) = self.snapshot.as_mut() {
                s.abandon()?;
            }
            if is_file_set_refusal(&e) {
                self.distrust_snapshot(&base);
            }
            return Err(e);
        }
        crate::failpoint::hit("publisher.after_latest");
        let snap = self.snapshot.as_mut().expect("checked above");
        let finished = if previous {
            snap.follow(std::mem::take(&mut cp.tensors), &deltas, after.clone())
        } else {
            snap.finish_delta(&deltas, after.clone())
        };
        if let Err(e) = finished {
            // The version's own deltas do not verify against the snapshot
            // they were made from: the checkpoint's bytes changed while the
            // diff read them (a caller's buffer written during the publish),
            // or the snapshot did. Subscribers refuse the version as well.
            // Nothing built on this snapshot can be trusted again: the next
            // version is an anchor, from a full read.
            tracing::error!(version = next, error = %e, "a committed delta does not verify against the publisher's snapshot; the next version will be an anchor");
            let mut recorded = after;
            recorded.tensor_files.clear();
            self.distrust_snapshot(&recorded);
            self.state = Some(recorded);
            return Err(Error::Integrity {
                scope: format!(
                    "the publisher's snapshot after applying committed version {next} ({e}); \
                     did the checkpoint change while it was being published? Subscribers refuse \
                     version {next}; the next version is an anchor"
                ),
                expected: "the digests the version's deltas record".into(),
                actual: "others".into(),
            });
        }
        self.state = Some(after);
        let notified = self.notify(next, base.anchor_version);
        let written = bytes + manifest_bytes;
        Ok(Published {
            version: next,
            kind: VersionKind::Delta,
            bytes: written,
            changed,
            total,
            step: opts.step,
            unchanged: false,
            anchor_reason: None,
            bridge_bytes: 0,
            notified,
            collected: None,
            egress_bytes: written + latest_bytes(next, base.anchor_version),
            // A subscriber one version behind reads the manifest and every
            // object of the version.
            fanout_bytes: written,
            fanout_subscribers: notified,
            local_write_bytes: None,
            diff_s: None,
        })
    }

    /// Stops trusting the snapshot, here and in `state.json` (which keeps
    /// `recorded`'s numbering): the next version is an anchor.
    fn distrust_snapshot(&mut self, recorded: &State) {
        self.snapshot = None;
        if let Err(e) = Snapshot::distrust(&self.cfg.state_dir, recorded) {
            tracing::warn!(error = %e, "cannot record the distrusted snapshot; a restart verifies it in full");
        }
    }

    /// Where a `planes` anchor of `written` can stream while it is
    /// compressed ([`Store::put_growing`]: the header's length reserved
    /// first, its bytes sent last): the header's length and a new spill file.
    /// `None` where the store cannot take parts out of order or the header
    /// is too large for one part: the caller compresses first, then uploads.
    fn streamable(
        &self,
        written: &crate::tensors::TensorSet,
        version: u64,
        opts: &crate::codec::planes::PlanesOptions,
        spill_dir: &Path,
    ) -> Result<Option<(usize, tempfile::NamedTempFile)>> {
        if !self.store.can_put_growing() {
            return Ok(None);
        }
        let head_len = crate::codec::planes_prefix_len(written, version, opts)?;
        if head_len > crate::store::PART_SIZE / 2 {
            return Ok(None);
        }
        Ok(Some((head_len, spill_file(spill_dir)?)))
    }

    /// Waits for `up` and records its object in `staging`; its size.
    async fn finished(staging: &mut Staging, up: Upload) -> Result<u64> {
        let entry = up.finish().await?;
        tracing::debug!(object = %entry.key, "anchor: object uploaded");
        let size = entry.size;
        staging.record(entry);
        Ok(size)
    }

    /// Publishes an anchor; `bridges` (deltas from the previous version, one per
    /// safetensors file, or none) go into the same version so that subscribers
    /// behind it can replay across it.
    ///
    /// Everything comes from one read of the checkpoint: its tensor files are
    /// written once as the new snapshot, and the anchor objects and the
    /// digests recorded for them are made from the files written, never from
    /// the checkpoint again. A checkpoint whose bytes change during the
    /// publish (a caller's buffers written meanwhile, a file rewritten in
    /// place) cannot make the snapshot, the objects and their digests
    /// disagree; with bridges, whose digests come from the diff's read, a
    /// change between the two reads is refused (nothing committed, the next
    /// version an anchor).
    async fn publish_anchor(
        &mut self,
        cp: &mut Checkpoint,
        mut staging: Staging,
        reason: String,
        bridges: Vec<(String, Vec<u8>)>,
        opts: &PublishOptions,
        staged: &dist::Staged,
    ) -> Result<Published> {
        let next = staging.version();
        let dir = self.cfg.state_dir.clone();
        let total = cp.total_elements();
        for (name, d) in &bridges {
            let key = staging.key(ObjectRole::Delta, name)?;
            staged.check(
                &key,
                d.len() as u64,
                crate::digest::blake3_of(d).to_hex().as_str(),
            )?;
        }
        // The new snapshot's files, written once; the anchor objects are
        // uploaded from them (the checkpoint may be rewritten by the trainer
        // once this publish returns; the snapshot is ours).
        let next_dir = Snapshot::next_dir(&dir);
        let _ = std::fs::remove_dir_all(&next_dir);
        // `--state-mode previous`: no snapshot of our own; the checkpoint's
        // files are the base (they must stay as they are until the next
        // publish, which checks their stamps): their digests and the planes
        // are made from the same mapping, and a rewrite in between changes
        // their stamps, checked before the commit. Raw anchors upload a
        // snapshot file's bytes, so they still write one.
        let own_base = self.cfg.state_mode == StateMode::Previous
            && self.cfg.anchor_encoding == AnchorEncoding::Planes
            && cp.tensor_paths().is_some();
        let mut anchor_bytes = 0u64;
        let mut tensor_files = BTreeMap::new();
        let spill_dir = dir.join("spill");
        // The objects upload in order while the next files are written and
        // compressed, so that the link waits on no file's stage: a `planes`
        // object streams while it is compressed (at most two uploads at
        // once, sharing the store's part budget: memory stays that of one
        // upload, and at most two spill files exist); otherwise one object
        // uploads while the next is compressed into its spill file. Each
        // file's snapshot write (or digest pass) runs alongside the previous
        // file's compression, on a thread of its own.
        let mut uploads: std::collections::VecDeque<Upload> = Default::default();
        let described = cp.describe();
        let mut files = cp.tensors.iter_mut();
        let mut ready = files.next().map(|(name, set)| {
            let p = blocking(|| prepare_file(own_base, &next_dir, name, set));
            (name.clone(), p)
        });
        while let Some((name, prepared)) = ready.take() {
            let (diffed, written) = prepared?;
            let digests = FileDigests::of(written.set());
            if diffed.is_some_and(|d| d != digests) {
                // The bridges were diffed from other bytes than the ones
                // just written.
                drop(uploads);
                let _ = std::fs::remove_dir_all(&next_dir);
                if let Some(st) = self.state.clone() {
                    self.distrust_snapshot(&st);
                } else {
                    self.snapshot = None;
                }
                return Err(Error::Conflict(format!(
                    "tensor file `{name}` of checkpoint {} changed while it was being published \
                     (its bytes differ between the diff and the snapshot); nothing was committed \
                     and the next version is an anchor. Publish again once the trainer has \
                     finished writing it",
                    described
                )));
            }
            tensor_files.insert(name.clone(), digests);
            let following = files.next();
            let key = staging.key(ObjectRole::Anchor, &name)?;
            let planes = self.cfg.anchor_encoding == AnchorEncoding::Planes;
            if planes && !staged.active() {
                // At most two uploads, and spill files, at once.
                while uploads.len() >= 2 {
                    let up = uploads.pop_front().expect("two in flight");
                    anchor_bytes += Self::finished(&mut staging, up).await?;
                }
                let opts = crate::codec::planes::PlanesOptions::default();
                if let Some((head_len, file)) =
                    self.streamable(written.set(), next, &opts, &spill_dir)?
                {
                    let (sink, up) = Upload::growing(&self.store, &name, key, head_len, file)?;
                    tracing::debug!(file = %name, "anchor: compressing while it uploads");
                    let (done, next_ready) = blocking(|| {
                        alongside(own_base, &next_dir, following, || {
                            crate::codec::write_anchor_planes(written.set(), next, opts, sink)
                        })
                    });
                    let done = done?;
                    done.sink.finish(done.prefix);
                    tracing::debug!(file = %name, "anchor: compressed");
                    uploads.push_back(up);
                    ready = next_ready;
                    continue;
                }
            }
            let (mut spill, mut later) = (None, None);
            let sources = if planes {
                // The compressed chunks go to a spill file (the header,
                // which comes first, needs their sizes), bounded memory.
                let file = spill_file(&spill_dir)?;
                let sink = std::io::BufWriter::with_capacity(
                    1 << 20,
                    file.reopen()
                        .map_err(|e| Error::io(format!("opening {}", file.path().display()), e))?,
                );
                let (done, next_ready) = blocking(|| {
                    alongside(own_base, &next_dir, following, || {
                        crate::codec::write_anchor_planes(
                            written.set(),
                            next,
                            crate::codec::planes::PlanesOptions::default(),
                            sink,
                        )
                    })
                });
                ready = next_ready;
                let done = done?;
                done.sink
                    .into_inner()
                    .map_err(|e| Error::io("writing a spill file", e.into_error()))?;
                let sources = vec![
                    Source::Bytes(Bytes::from(done.prefix)),
                    Source::File {
                        path: file.path().to_path_buf(),
                        offset: 0,
                        len: done.data_bytes,
                    },
                ];
                spill = Some(file);
                sources
            } else {
                // Uploaded from the snapshot file itself, once the previous
                // object is up; the next file is written meanwhile.
                let sources = vec![
                    Source::Bytes(Bytes::from(anchor_prefix(written.set(), next)?)),
                    Source::File {
                        path: next_dir.join(&name),
                        offset: written.data_start(),
                        len: written.set().total_bytes(),
                    },
                ];
                later = following;
                sources
            };
            if staged.active() {
                let (size, blake3) = hash_sources(&sources)?;
                staged.check(&key, size, &blake3)?;
            }
            tracing::debug!(file = %name, "anchor: compressed");
            while let Some(up) = uploads.pop_front() {
                anchor_bytes += Self::finished(&mut staging, up).await?;
            }
            uploads.push_back(Upload::start(&self.store, name, key, sources, spill));
            if let Some((n, set)) = later {
                let p = blocking(|| prepare_file(own_base, &next_dir, n, set));
                ready = Some((n.clone(), p));
            }
        }
        while let Some(up) = uploads.pop_front() {
            anchor_bytes += Self::finished(&mut staging, up).await?;
        }
        if !own_base {
            crate::fsio::sync_dir(&next_dir)?;
        }
        let bridged = !bridges.is_empty();
        let mut bridge_bytes = 0u64;
        for (name, d) in bridges {
            bridge_bytes += d.len() as u64;
            staging
                .upload(&self.store, &name, ObjectRole::Delta, Bytes::from(d))
                .await?;
        }
        let (files, file_bytes) = self
            .upload_files(cp, &mut staging, &BTreeMap::new(), staged)
            .await?;
        cp.check_unchanged()?;
        let writer = staging.writer().to_string();
        let manifest = staging.manifest(
            VersionKind::Anchor,
            bridged.then(|| next - 1),
            next,
            opts.step,
        );
        let manifest_bytes = manifest_size(&manifest);
        let bytes = anchor_bytes + bridge_bytes + file_bytes + manifest_bytes;
        let after = State {
            version: next,
            writer: writer.clone(),
            anchor_version: next,
            anchor_bytes,
            bytes_since_anchor: 0,
            step: opts.step,
            world: self.cfg.distributed.as_ref().map(|d| d.world),
            files,
            tensor_files,
            overlay: Vec::new(),
            snapshot_files: BTreeMap::new(),
            stamps: BTreeMap::new(),
            base: BTreeMap::new(),
            pending: None,
        };
        let mut after = after;
        if own_base {
            // As for a delta (`publish_delta`): the files' paths and stamps,
            // checked against those the reads began with.
            after.base = cp.tensor_paths().cloned().unwrap_or_default();
            after.stamps = Snapshot::take_stamps(&dir, &after, cp.tensors.keys())?;
            cp.check_unchanged()?;
        }
        // Record the commit in flight (in the old state, which stays valid if
        // it does not happen).
        let mut pending = self.state.clone().unwrap_or_default();
        pending.pending = Some(state::Pending {
            version: next,
            writer,
            kind: VersionKind::Anchor,
            after: Box::new(after.clone()),
        });
        state::write_state(&dir, &pending)?;
        crate::failpoint::hit("publisher.before_commit");
        if let Err(e) = self.commit(&manifest, cp).await {
            let _ = std::fs::remove_dir_all(&next_dir);
            let mut back = pending;
            back.pending = None;
            state::write_state(&dir, &back)?;
            return Err(e);
        }
        crate::failpoint::hit("publisher.after_latest");
        // The old snapshot's mappings go before its files are replaced.
        self.snapshot = None;
        if own_base {
            self.snapshot = Some(state::install_base(
                &dir,
                std::mem::take(&mut cp.tensors),
                after.clone(),
            )?);
        } else {
            self.snapshot = Some(state::install_anchor(
                &dir,
                self.cfg.state_mode,
                after.clone(),
            )?);
        }
        self.state = Some(after);
        let notified = self.notify(next, next);
        let collected = self.collect().await;
        // A subscriber one version behind replays the bridges (and the
        // changed files); without bridges it loads the anchor.
        let fanout_bytes = if bridged {
            bridge_bytes + file_bytes + manifest_bytes
        } else {
            bytes
        };
        Ok(Published {
            version: next,
            kind: VersionKind::Anchor,
            bytes,
            changed: total,
            total,
            step: opts.step,
            unchanged: false,
            anchor_reason: Some(reason),
            bridge_bytes,
            notified,
            collected,
            egress_bytes: bytes + latest_bytes(next, next),
            fanout_bytes,
            fanout_subscribers: notified,
            local_write_bytes: None,
            diff_s: None,
        })
    }

    /// Lists every non-tensor file in the version and uploads those that
    /// differ from `previous` (name → (size, BLAKE3)), streaming each.
    /// Returns the new file table and the bytes uploaded.
    async fn upload_files(
        &self,
        cp: &Checkpoint,
        staging: &mut Staging,
        previous: &BTreeMap<String, (u64, String)>,
        staged: &dist::Staged,
    ) -> Result<(BTreeMap<String, (u64, String)>, u64)> {
        let mut table = BTreeMap::new();
        let mut bytes = 0;
        for (name, src) in &cp.files {
            let (size, hash) = checkpoint::hash_file(src)?;
            staging.list_file(name, size, hash.clone());
            table.insert(name.clone(), (size, hash.clone()));
            if previous.get(name) == Some(&(size, hash.clone())) {
                continue;
            }
            let source = match src {
                FileSource::Bytes(b) => Source::Bytes(b.clone()),
                FileSource::Path { path, .. } => Source::File {
                    path: path.clone(),
                    offset: 0,
                    len: size,
                },
            };
            let key = staging.key(ObjectRole::File, name)?;
            staged.check(&key, size, &hash)?;
            let (sent, blake3) = self.store.put_sources(&key, &[source]).await?;
            if blake3 != hash {
                return Err(Error::Conflict(format!(
                    "checkpoint file `{name}` changed while it was being published; publish it \
                     again once the trainer has finished writing it"
                )));
            }
            bytes += sent;
            staging.record(crate::protocol::ObjectEntry {
                name: name.clone(),
                role: ObjectRole::File,
                key,
                size: sent,
                blake3,
            });
        }
        Ok((table, bytes))
    }

    /// Commits a manifest and updates the hint. A distributed rank commits
    /// its share of the version with the other ranks' (see [`dist::commit`]).
    async fn commit(&self, manifest: &Manifest, cp: &Checkpoint) -> Result<()> {
        self.gate.begin_commit()?;
        if let Some(d) = &self.cfg.distributed {
            let tensors = cp
                .tensors
                .iter()
                .map(|(f, s)| {
                    (
                        f.clone(),
                        s.tensors().iter().map(|t| t.name.clone()).collect(),
                    )
                })
                .collect();
            dist::commit(&self.store, d, manifest, tensors).await?;
            dist::clean_up(&self.store, d, manifest.version).await;
            return Ok(());
        }
        match commit(&self.store, manifest).await? {
            Commit::Committed => crate::failpoint::hit("publisher.after_commit"),
            Commit::VersionTaken => {
                return Err(Error::Conflict(format!(
                    "{LOST_RACE}: version {} was committed by another publisher first",
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
        .await
    }

    /// Automatic retention after an anchor; never fails the publish.
    async fn collect(&self) -> Option<crate::protocol::Collected> {
        if self.cfg.distributed.as_ref().is_some_and(|d| d.rank != 0) {
            return None;
        }
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

    /// Notifies the static and registered subscribers in a background task
    /// (reading the registrations and the fan-out never delay the publish,
    /// and never fail it). `Some(0)` when there is nobody to notify: no
    /// notify key, or a distributed rank other than 0 (rank 0 notifies for
    /// all); `None` when a notification is under way.
    fn notify(&mut self, version: u64, anchor_version: u64) -> Option<usize> {
        // Reap the notifications of earlier versions that finished.
        while self.notifications.try_join_next().is_some() {}
        let Some(key) = self.cfg.notify_key.clone() else {
            return Some(0);
        };
        if self.cfg.distributed.as_ref().is_some_and(|d| d.rank != 0) {
            return Some(0);
        }
        let max_age = crate::notify::registration_horizon(self.cfg.retention.as_ref());
        let (store, urls) = (self.store.clone(), self.cfg.notify_urls.clone());
        let n = crate::notify::Notification {
            store: self.store.url().to_string(),
            version,
            anchor_version,
        };
        self.notifications.spawn(async move {
            let urls = crate::notify::fleet_urls(&store, &urls, max_age).await;
            let d = crate::notify::send(&urls, &key, &n).await;
            let ok = d.iter().filter(|d| d.ok).count();
            tracing::info!(
                version,
                notified = ok,
                subscribers = urls.len(),
                "notifications sent"
            );
            (ok, urls.len())
        });
        None
    }

    /// Waits for the notifications under way (a one-shot process calls this
    /// before it exits); returns how many subscribers acknowledged them.
    pub async fn notifications_settled(&mut self) -> usize {
        let mut ok = 0;
        while let Some(r) = self.notifications.join_next().await {
            let (acks, targets) = r.unwrap_or((0, 0));
            ok += acks;
            self.last_fanout = targets;
        }
        ok
    }

    /// [`Publisher::publish`], then waits for its notifications, so that
    /// `notified` is known (what `weightcast publish` prints).
    pub async fn publish_and_notify(
        &mut self,
        cp: Checkpoint,
        opts: &PublishOptions,
    ) -> Result<Published> {
        let mut p = self.publish(cp, opts).await?;
        if p.notified.is_none() {
            p.notified = Some(self.notifications_settled().await);
            p.fanout_subscribers = Some(self.last_fanout);
        }
        Ok(p)
    }
}

impl Position {
    /// A step must be newer than the last committed version's.
    fn check_step(&self, opts: &PublishOptions) -> Result<()> {
        if let (Some(step), Some(last)) = (opts.step, self.last_step)
            && step <= last
        {
            return Err(Error::Conflict(format!(
                "step {step} is not newer than step {last} of the last committed version {}; \
                 steps must increase",
                self.last.unwrap_or_default()
            )));
        }
        Ok(())
    }

    /// The number of the next version. A bucket whose newest manifest claims
    /// the last possible version (something other than weightcast wrote it)
    /// is refused by name rather than wrapped around.
    fn next(&self) -> Result<u64> {
        match self.last {
            None => Ok(0),
            Some(v) => v.checked_add(1).ok_or_else(|| {
                Error::metadata(
                    crate::protocol::manifest_key(v),
                    "claims the last possible version, so no version can follow it; \
                     remove it (weightcast never numbers versions this high)",
                )
            }),
        }
    }
}

/// The manifest of `version`, or `None` when it is missing — or unreadable: a
/// manifest that fails validation (damaged, or written by something hostile)
/// is nothing a publisher can build on, and must not stop it from
/// publishing; the next version is then an anchor after it. Store errors are
/// returned.
/// `--state-mode previous` with a checkpoint that is not files on disk.
pub(crate) fn previous_needs_files() -> Error {
    Error::Config(
        "--state-mode previous makes each checkpoint on disk the next delta's base; this \
         publish has none (a checkpoint from memory, handed-over changes, or the TRL layout): \
         use --state-mode auto, overlay or in-place"
            .into(),
    )
}

async fn readable_manifest(store: &Store, version: u64) -> Result<Option<Manifest>> {
    match read_manifest(store, version).await {
        Err(e) if e.kind() == crate::error::ErrorKind::Corrupt => {
            tracing::warn!(version, error = %e, "the bucket's newest manifest is unreadable; the next version will be an anchor after it");
            Ok(None)
        }
        other => other,
    }
}

/// How a lost commit race is worded (the retry recognizes it).
const LOST_RACE: &str = "lost the commit race";

/// Whether `e` is a distributed commit refused because its safetensors
/// files are not its base's ([`crate::protocol::parts::check_delta_files`]).
fn is_file_set_refusal(e: &Error) -> bool {
    matches!(e, Error::Conflict(m) if m.starts_with(crate::protocol::parts::FILE_SET_CHANGED))
}

/// Whether the checkpoint has exactly the snapshot's tensor files.
fn same_files(snap: &Snapshot, cp: &Checkpoint) -> bool {
    cp.tensors.len() == snap.sets.len() && cp.tensors.keys().all(|k| snap.sets.contains_key(k))
}

fn manifest_size(m: &Manifest) -> u64 {
    serde_json::to_vec_pretty(m).map_or(0, |v| v.len() as u64)
}

/// Writes `set` as a plain safetensors file (its own metadata kept) at
/// `path`, streaming from wherever its bytes are, and maps it back with its
/// digests computed from the bytes written (one pass over the page cache):
/// what an anchor and the snapshot are made from, whatever happens to
/// `set`'s own bytes meanwhile. Returns the mapped file and where its tensor
/// data starts.
fn write_snapshot_file(
    path: &Path,
    set: &crate::tensors::TensorSet,
) -> Result<(crate::tensors::TensorSet, u64)> {
    let data_start = write_plain_file(path, set)?;
    let written = crate::tensors::TensorSet::map(path, false, crate::tensors::Digests::Compute)?;
    Ok((written, data_start))
}

/// A tensor file ready to be made an anchor object from: the checkpoint's
/// own (its digests computed) or the snapshot file written from it.
enum Prepared<'a> {
    /// `--state-mode previous`: the checkpoint's file is the base.
    Base(&'a crate::tensors::TensorSet),
    /// The snapshot file, mapped, and where its tensor data starts.
    Snapshot(crate::tensors::TensorSet, u64),
}

impl Prepared<'_> {
    fn set(&self) -> &crate::tensors::TensorSet {
        match self {
            Prepared::Base(s) => s,
            Prepared::Snapshot(s, _) => s,
        }
    }

    fn data_start(&self) -> u64 {
        match self {
            Prepared::Base(_) => 0,
            Prepared::Snapshot(_, d) => *d,
        }
    }
}

/// The digests `set` had (from the diff, if any) and the file an anchor
/// object is made from: the checkpoint's with its digests computed
/// (`own_base`), else the snapshot file written at `dir`/`name`.
fn prepare_file<'a>(
    own_base: bool,
    dir: &Path,
    name: &str,
    set: &'a mut crate::tensors::TensorSet,
) -> Result<(Option<FileDigests>, Prepared<'a>)> {
    let diffed = set.has_digests().then(|| FileDigests::of(set));
    if own_base {
        set.compute_digests();
        return Ok((diffed, Prepared::Base(set)));
    }
    tracing::debug!(file = %name, "anchor: writing the snapshot file");
    let (written, data_start) = write_snapshot_file(&dir.join(name), set)?;
    tracing::debug!(file = %name, "anchor: snapshot file written");
    Ok((diffed, Prepared::Snapshot(written, data_start)))
}

/// Runs `work` here and, alongside it on a thread of its own, prepares the
/// `following` file ([`prepare_file`]): one file's snapshot write overlaps
/// the previous one's compression.
#[allow(clippy::type_complexity)]
fn alongside<'a, T>(
    own_base: bool,
    dir: &Path,
    following: Option<(&'a String, &'a mut crate::tensors::TensorSet)>,
    work: impl FnOnce() -> T,
) -> (
    T,
    Option<(String, Result<(Option<FileDigests>, Prepared<'a>)>)>,
) {
    let Some((name, set)) = following else {
        return (work(), None);
    };
    std::thread::scope(|s| {
        let h = s.spawn(move || prepare_file(own_base, dir, name, set));
        let t = work();
        let p = h.join().unwrap_or_else(|e| std::panic::resume_unwind(e));
        (t, Some((name.clone(), p)))
    })
}

/// An anchor object uploading in a task of its own (see
/// [`Publisher::publish_anchor`]); dropped unfinished, the upload is
/// cancelled (an incomplete multipart upload is the bucket's lifecycle rule's
/// to remove, and nothing refers to the object).
struct Upload {
    name: String,
    key: String,
    task: tokio_util::task::AbortOnDropHandle<Result<(u64, String)>>,
}

impl Upload {
    /// Starts uploading `sources` as object `key`; `spill` (the file the
    /// sources read from, if any) lives until the upload ends.
    fn start(
        store: &Store,
        name: String,
        key: String,
        sources: Vec<Source>,
        spill: Option<tempfile::NamedTempFile>,
    ) -> Upload {
        let store = store.clone();
        let k = key.clone();
        let task = tokio_util::task::AbortOnDropHandle::new(tokio::spawn(async move {
            let r = store.put_sources(&k, &sources).await;
            drop(spill);
            r
        }));
        Upload { name, key, task }
    }

    /// Starts uploading object `key` as a head of `head_len` bytes followed
    /// by what the returned writer appends to `spill` ([`Store::put_growing`]);
    /// `spill` lives until the upload ends.
    fn growing(
        store: &Store,
        name: &str,
        key: String,
        head_len: usize,
        spill: tempfile::NamedTempFile,
    ) -> Result<(crate::store::GrowingWriter, Upload)> {
        let (sink, growing) = crate::store::growing(spill.path())?;
        let store = store.clone();
        let k = key.clone();
        let task = tokio_util::task::AbortOnDropHandle::new(tokio::spawn(async move {
            let r = store.put_growing(&k, head_len, growing).await;
            drop(spill);
            r
        }));
        let up = Upload {
            name: name.to_string(),
            key,
            task,
        };
        Ok((sink, up))
    }

    /// Waits for the upload; the object's manifest entry.
    async fn finish(self) -> Result<crate::protocol::ObjectEntry> {
        let (size, blake3) = self.task.await.map_err(|e| {
            Error::io(
                format!("uploading object {}", self.key),
                std::io::Error::other(e),
            )
        })??;
        crate::failpoint::hit("publisher.mid_upload");
        Ok(crate::protocol::ObjectEntry {
            name: self.name,
            role: ObjectRole::Anchor,
            key: self.key,
            size,
            blake3,
        })
    }
}

/// A new spill file for an anchor object's compressed chunks, in `dir`
/// (created if missing); removed when dropped.
fn spill_file(dir: &Path) -> Result<tempfile::NamedTempFile> {
    std::fs::create_dir_all(dir)
        .map_err(|e| Error::io(format!("creating {}", dir.display()), e))?;
    tempfile::NamedTempFile::new_in(dir)
        .map_err(|e| Error::io(format!("creating a spill file in {}", dir.display()), e))
}

/// Runs `f`, which blocks on the CPU, letting a multi-threaded runtime move
/// this worker's other tasks (an upload in flight) elsewhere meanwhile.
fn blocking<T>(f: impl FnOnce() -> T) -> T {
    match tokio::runtime::Handle::try_current() {
        Ok(h) if h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => {
            tokio::task::block_in_place(f)
        }
        _ => f(),
    }
}

/// Size and BLAKE3 of what `sources` upload, read locally (a restarted rank
/// checks an anchor object against its earlier part before uploading it).
fn hash_sources(sources: &[Source]) -> Result<(u64, String)> {
    use std::io::{Read, Seek};
    let mut h = blake3::Hasher::new();
    let mut n = 0u64;
    for s in sources {
        match s {
            Source::Bytes(b) => {
                h.update(b);
            }
            Source::File { path, offset, len } => {
                let io = |e| Error::io(format!("reading {}", path.display()), e);
                let mut f = std::fs::File::open(path).map_err(io)?;
                f.seek(std::io::SeekFrom::Start(*offset)).map_err(io)?;
                h.update_reader(f.take(*len)).map_err(io)?;
            }
        }
        n += s.len();
    }
    Ok((n, h.finalize().to_hex().to_string()))
}

/// Writes `set` as a plain safetensors file at `path`; returns where the
/// tensor data starts.
fn write_plain_file(path: &Path, set: &crate::tensors::TensorSet) -> Result<u64> {
    use std::io::Write;
    let io = |what: &str, e| Error::io(format!("{what} {}", path.display()), e);
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).map_err(|e| io("creating", e))?;
    }
    let file = std::fs::File::create(path).map_err(|e| io("creating", e))?;
    let mut w = std::io::BufWriter::with_capacity(8 << 20, file);
    set.write_to(set.metadata(), &mut w)?;
    w.flush().map_err(|e| io("writing", e))?;
    // Durable before the state records its stamp (a start trusts it by that).
    w.get_ref().sync_all().map_err(|e| io("syncing", e))?;
    let len = w.get_ref().metadata().map_err(|e| io("writing", e))?.len();
    Ok(len - set.total_bytes())
}
