//! Publishing in TRL's own bucket layout (`publish --layout trl`): the bucket
//! a TRL receiver consumes unchanged (docs/format.md §11).
//!
//! One safetensors object per step, at the prefix root, named by TRL's step
//! (version + 1): `anchors/step_NNNNNN.safetensors` at step 1 and every
//! multiple of the anchor interval (complete: every tensor), otherwise
//! `deltas/step_NNNNNN.safetensors` in the configured TRL generation, with
//! TRL's header keys beside weightcast's (digests, so a weightcast follower
//! verifies what it replays). TRL writes one file: the checkpoint's tensor
//! files are published as one (tensor names must be unique across them);
//! non-tensor files have no place in TRL's layout and are not published.
//!
//! TRL's layout has no commit protocol: an object is visible once written.
//! Deltas are created with a conditional create, so a second writer cannot
//! overwrite one; anchors go up in parallel parts. The snapshot is kept as in
//! the weightcast layout (in place, journaled); the commit this publisher
//! recognizes as its own after a crash is the object at its step's key with
//! the size it recorded.

use bytes::Bytes;

use crate::error::{Error, Result};
use crate::protocol::VersionKind;
use crate::protocol::trl::{self as layout, anchor_key, delta_key, is_anchor_step};
use crate::store::{Created, Source};
use crate::tensors::TensorSet;

use super::state::{self, FileDigests, Snapshot, State};
use super::{Checkpoint, PublishOptions, Published, Publisher, write_snapshot_file};

/// The single tensor file of a TRL-layout snapshot.
pub(super) const FILE: &str = "model.safetensors";

/// What a TRL-layout commit records as its writer: the object's key and size.
pub(super) fn commit_token(key: &str, size: u64) -> String {
    format!("{key} {size}")
}

impl Publisher {
    pub(super) async fn publish_trl(
        &mut self,
        cp: Checkpoint,
        opts: &PublishOptions,
    ) -> Result<Published> {
        if !cp.files.is_empty() {
            tracing::warn!(
                files = ?cp.files.keys().collect::<Vec<_>>(),
                "TRL's layout holds tensors only; the checkpoint's other files are not published"
            );
        }
        cp.check_unchanged()?;
        let total = cp.total_elements();
        let describe = cp.describe();
        let mut set = TensorSet::merge(cp.tensors.into_values().collect())
            .map_err(|e| e.in_input(format!("checkpoint {describe}")))?;
        let listing = layout::listing(&self.store).await?;
        let newest_step = listing
            .anchors
            .keys()
            .chain(listing.deltas.keys())
            .max()
            .copied();
        // Trusted: the bucket holds nothing after our last step, and the last
        // object we wrote is still there. (TRL v3 writes no object for a step
        // without changes, so the bucket's newest step may be older than ours.)
        if let Some(snap) = &self.snapshot {
            let our_step = snap.state.version + 1;
            let ok = newest_step.is_some_and(|n| n <= our_step)
                && crate::protocol::trl::token_present(&self.store, &snap.state.writer).await?;
            if !ok {
                tracing::warn!(
                    our_step,
                    bucket = ?newest_step,
                    "the TRL bucket is not at this publisher's last step; the next step will be an anchor"
                );
                self.snapshot = None;
            }
        }
        let last_version = match (&self.snapshot, newest_step) {
            (Some(s), _) => Some(s.state.version),
            (None, n) => {
                let recorded = self
                    .state
                    .as_ref()
                    .filter(|s| !s.writer.is_empty())
                    .map(|s| s.version);
                let from_bucket = n.map(|s| s - 1);
                match (recorded, from_bucket) {
                    (Some(a), Some(b)) => Some(a.max(b)),
                    (a, b) => a.or(b),
                }
            }
        };
        if let (Some(step), Some(last)) = (opts.step, self.state.as_ref().and_then(|s| s.step))
            && step <= last
        {
            return Err(Error::Conflict(format!(
                "step {step} is not newer than step {last} of the last published version; steps must increase"
            )));
        }
        let next = last_version.map_or(0, |v| v + 1);
        let step = next + 1;
        let every = self.cfg.anchors.every;
        let base = self.snapshot.as_ref().filter(|s| {
            s.sets
                .get(FILE)
                .is_some_and(|b| b.same_structure(&set).is_ok())
        });
        let anchor = base.is_none() || is_anchor_step(step, every);
        if anchor {
            self.publish_trl_anchor(set, next, total, opts).await
        } else {
            let snap = base.expect("checked");
            let (bytes, summary) =
                layout::encode_delta(&snap.sets[FILE], &mut set, step, &self.cfg.trl)?;
            self.publish_trl_delta(set, next, bytes, summary.changed, total, opts)
                .await
        }
    }

    async fn publish_trl_delta(
        &mut self,
        set: TensorSet,
        next: u64,
        bytes: Vec<u8>,
        changed: u64,
        total: u64,
        opts: &PublishOptions,
    ) -> Result<Published> {
        // TRL's layout commits by writing the step's object: from here the
        // publish runs to its end.
        self.gate.begin_commit()?;
        let step = next + 1;
        let snap = self.snapshot.as_mut().expect("a delta implies a snapshot");
        let base = snap.state.clone();
        // TRL v3 writes nothing for a step without changes; the state still
        // moves on (the step is taken).
        let write = !(changed == 0 && self.cfg.trl.generation == crate::format::TrlGeneration::V3);
        let key = delta_key(step);
        let size = bytes.len() as u64;
        let token = if write {
            commit_token(&key, size)
        } else {
            base.writer.clone()
        };
        let after = State {
            version: next,
            writer: token.clone(),
            anchor_version: base.anchor_version,
            anchor_bytes: base.anchor_bytes,
            bytes_since_anchor: base.bytes_since_anchor + if write { size } else { 0 },
            step: opts.step,
            files: Default::default(),
            tensor_files: [(FILE.to_string(), FileDigests::of(&set))].into(),
            world: None,
            overlay: Vec::new(),
            snapshot_files: Default::default(),
            stamps: Default::default(),
            base: Default::default(),
            pending: None,
        };
        let deltas = vec![(FILE.to_string(), bytes)];
        snap.prepare_delta(next, &token, &deltas, after.clone())?;
        crate::failpoint::hit("publisher.before_commit");
        if write {
            let created = self
                .store
                .create(&key, Bytes::from(deltas[0].1.clone()))
                .await;
            match created {
                Ok(Created::Created) => {}
                Ok(Created::AlreadyExists) => {
                    snap_abandon(self)?;
                    return Err(Error::Conflict(format!(
                        "`{key}` already exists in the TRL bucket: another writer published step \
                         {step}. TRL's layout supports one writer; the next publish resyncs."
                    )));
                }
                Err(e) => {
                    snap_abandon(self)?;
                    return Err(e);
                }
            }
        }
        crate::failpoint::hit("publisher.after_commit");
        let snap = self.snapshot.as_mut().expect("checked above");
        snap.finish_delta(&deltas, after.clone())?;
        self.state = Some(after);
        Ok(Published {
            version: next,
            kind: VersionKind::Delta,
            bytes: if write { size } else { 0 },
            changed,
            total,
            step: opts.step,
            unchanged: false,
            anchor_reason: None,
            bridge_bytes: 0,
            notified: Some(0),
            collected: None,
            egress_bytes: if write { size } else { 0 },
            fanout_bytes: if write { size } else { 0 },
            fanout_subscribers: Some(0),
            local_write_bytes: None,
            diff_s: None,
        })
    }

    async fn publish_trl_anchor(
        &mut self,
        set: TensorSet,
        next: u64,
        total: u64,
        opts: &PublishOptions,
    ) -> Result<Published> {
        // The anchor object's upload is the commit (see the delta's).
        self.gate.begin_commit()?;
        let dir = self.cfg.state_dir.clone();
        let step = next + 1;
        let next_dir = Snapshot::next_dir(&dir);
        let _ = std::fs::remove_dir_all(&next_dir);
        let path = next_dir.join(FILE);
        // The anchor and its digests come from the file written, never from
        // the checkpoint again (see `Publisher::publish_anchor`).
        let (written, data_start) = write_snapshot_file(&path, &set)?;
        let set = written;
        crate::fsio::sync_dir(&next_dir)?;
        let prefix = crate::codec::trl::anchor_prefix(&set, next, &self.cfg.trl)?;
        let key = anchor_key(step);
        let sources = [
            Source::Bytes(Bytes::from(prefix)),
            Source::File {
                path,
                offset: data_start,
                len: set.total_bytes(),
            },
        ];
        let size: u64 = sources.iter().map(Source::len).sum();
        let token = commit_token(&key, size);
        let after = State {
            version: next,
            writer: token.clone(),
            anchor_version: next,
            anchor_bytes: size,
            bytes_since_anchor: 0,
            step: opts.step,
            files: Default::default(),
            tensor_files: [(FILE.to_string(), FileDigests::of(&set))].into(),
            world: None,
            overlay: Vec::new(),
            snapshot_files: Default::default(),
            stamps: Default::default(),
            base: Default::default(),
            pending: None,
        };
        let mut pending = self.state.clone().unwrap_or_default();
        pending.pending = Some(state::Pending {
            version: next,
            writer: token,
            kind: VersionKind::Anchor,
            after: Box::new(after.clone()),
        });
        state::write_state(&dir, &pending)?;
        crate::failpoint::hit("publisher.before_commit");
        if let Err(e) = self.store.put_sources(&key, &sources).await {
            let _ = std::fs::remove_dir_all(&next_dir);
            pending.pending = None;
            state::write_state(&dir, &pending)?;
            return Err(e);
        }
        crate::failpoint::hit("publisher.after_commit");
        self.snapshot = None;
        self.snapshot = Some(state::install_anchor(
            &dir,
            self.cfg.state_mode,
            after.clone(),
        )?);
        self.state = Some(after);
        Ok(Published {
            version: next,
            kind: VersionKind::Anchor,
            bytes: size,
            changed: total,
            total,
            step: opts.step,
            unchanged: false,
            anchor_reason: Some(if is_anchor_step(step, self.cfg.anchors.every) {
                format!(
                    "TRL anchors at step 1 and every {} steps",
                    self.cfg.anchors.every
                )
            } else {
                "no trusted snapshot of the bucket's last step".into()
            }),
            bridge_bytes: 0,
            notified: Some(0),
            collected: None,
            egress_bytes: size,
            fanout_bytes: size,
            fanout_subscribers: Some(0),
            local_write_bytes: None,
            diff_s: None,
        })
    }
}

fn snap_abandon(p: &mut Publisher) -> Result<()> {
    match p.snapshot.as_mut() {
        Some(s) => s.abandon(),
        None => Ok(()),
    }
}
