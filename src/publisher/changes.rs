//! Publishing changes the caller has already found: a trainer on a GPU keeps
//! a device copy of the last version it published, compares on the device,
//! and hands over only the changed positions and their new words. The delta
//! is encoded from those (old words read from the snapshot at the changed
//! positions), and the snapshot advances by the delta as usual: nothing on
//! the host reads the whole model.
//!
//! The snapshot stays the authority. A listed word equal to the snapshot's
//! means the caller's copy is not the snapshot; then, and whenever a version
//! must be an anchor, nothing is written and the caller is told to publish
//! the full tensors ([`ChangesOutcome::NeedsFull`]).

use std::collections::BTreeMap;

use bytes::Bytes;

use super::state::FileDigests;
use super::{LOST_RACE, PublishOptions, Published, Publisher, checkpoint::Checkpoint};
use crate::codec::compact::PositionSlice;
use crate::codec::{DeltaOptions, TensorChanges, encode_delta_changes};
use crate::dtype::Dtype;
use crate::error::{Error, Result};
use crate::format::Encoding;
use crate::protocol::Staging;

/// One tensor of a version given as its changes.
#[derive(Clone, Debug)]
pub struct ChangedTensor<'a> {
    /// The tensor's name.
    pub name: String,
    /// Its dtype, as the caller holds it (must be the snapshot's).
    pub dtype: Dtype,
    /// Its shape (must be the snapshot's).
    pub shape: Vec<usize>,
    /// Changed word indices, strictly ascending (none: unchanged).
    pub positions: PositionSlice<'a>,
    /// Their new words, in order.
    pub new: &'a [u8],
}

/// A version given as changes: per tensor file, every tensor it holds.
#[derive(Clone, Debug, Default)]
pub struct Changes<'a> {
    /// Tensor file name → its tensors (all of them, changed or not).
    pub tensor_files: BTreeMap<String, Vec<ChangedTensor<'a>>>,
    /// Other files (config, tokenizer) as in [`Checkpoint::from_sets`].
    pub files: BTreeMap<String, Bytes>,
}

/// What [`Publisher::publish_changes`] did.
#[derive(Debug)]
pub enum ChangesOutcome {
    /// The version is committed (or unchanged).
    Published(Box<Published>),
    /// Nothing was written: the version cannot be a delta made from these
    /// changes (the reason says why: an anchor is due, the structure changed,
    /// the changes were found against another state, ...). Publish the full
    /// tensors with [`Publisher::publish`].
    NeedsFull(String),
}

impl Publisher {
    /// Publishes the next version from changes found by the caller against
    /// the last version this publisher committed (a `compact` delta). The
    /// changed positions are checked against the snapshot (strictly
    /// ascending, inside their tensor, each word different from the
    /// snapshot's); malformed changes are an error, and changes found against
    /// another state give [`ChangesOutcome::NeedsFull`].
    pub async fn publish_changes(
        &mut self,
        changes: Changes<'_>,
        opts: &PublishOptions,
    ) -> Result<ChangesOutcome> {
        let full = |why: String| Ok(ChangesOutcome::NeedsFull(why));
        self.gate.begin_publish()?;
        if self.cfg.layout == crate::protocol::Layout::Trl {
            return full("the TRL layout publishes full files".into());
        }
        if self.cfg.distributed.is_some() {
            return full("a rank of a distributed publisher diffs its own files".into());
        }
        if self.cfg.state_mode == super::StateMode::Previous {
            return Err(super::previous_needs_files());
        }
        if self.cfg.encoding != Encoding::Compact {
            return full(format!(
                "encoding `{}`: changes are encoded as `compact` only",
                self.cfg.encoding
            ));
        }
        let Changes {
            mut tensor_files,
            files,
        } = changes;
        let names: Vec<String> = tensor_files.keys().cloned().collect();
        let mut cp = Checkpoint::for_changes(&names, files)?;
        if cp.name_single_file() {
            // Published under the name a checkpoint of one file gets.
            let stable = cp.tensors.keys().next().expect("one file").clone();
            let set = tensor_files.pop_first().expect("one file").1;
            tensor_files.insert(stable, set);
        }
        let pos = self.position().await?;
        pos.check_step(opts)?;
        let next = pos.next()?;
        if let Some(why) = self.anchor_reason(&cp, next) {
            return full(why);
        }
        let snap = self.snapshot.as_ref().expect("anchor_reason checked it");
        let dopts = DeltaOptions {
            encoding: Encoding::Compact,
            model_version: next,
            base_version: next - 1,
            ..DeltaOptions::default()
        };
        let started = std::time::Instant::now();
        let mut deltas = Vec::with_capacity(tensor_files.len());
        let mut digests = BTreeMap::new();
        let (mut changed, mut total) = (0u64, 0u64);
        for (file, tensors) in &tensor_files {
            let base = &snap.sets[file];
            if let Some(why) = structure_differs(base, tensors) {
                return full(format!("{file}: {why}"));
            }
            let given: Vec<TensorChanges<'_>> = tensors
                .iter()
                .map(|t| TensorChanges {
                    name: &t.name,
                    positions: t.positions,
                    new: t.new,
                })
                .collect();
            let (bytes, summary, tensor_digests) = match encode_delta_changes(base, &given, &dopts)
            {
                Ok(d) => d,
                Err(e @ Error::BaseMismatch(_)) => {
                    return full(format!(
                        "{file}: the changes were not found against version {}: {e}",
                        next - 1
                    ));
                }
                Err(e) => return Err(e.in_input(format!("tensor file `{file}`"))),
            };
            changed += summary.changed;
            total += summary.total;
            let digests_of = FileDigests {
                tensors: base
                    .tensors()
                    .iter()
                    .zip(&tensor_digests)
                    .map(|(t, d)| (t.name.clone(), d.to_string()))
                    .collect(),
            };
            digests.insert(file.clone(), digests_of);
            deltas.push((file.clone(), bytes));
        }
        let st = &snap.state;
        if changed == 0 && self.files_unchanged(&cp)? {
            return Ok(ChangesOutcome::Published(Box::new(Published::unchanged(
                st, total,
            ))));
        }
        let delta_bytes: u64 = deltas.iter().map(|d| d.1.len() as u64).sum();
        if let Some((why, _)) = self.size_reason(st, delta_bytes) {
            return full(why);
        }
        let diff_s = Some(started.elapsed().as_secs_f64());
        let out = self
            .publish_delta(
                &mut cp,
                Staging::new(next),
                super::DeltaParts {
                    deltas,
                    changed,
                    total,
                    tensor_files: digests,
                },
                opts,
                &Default::default(),
            )
            .await;
        match out {
            Ok(p) => Ok(ChangesOutcome::Published(Box::new(Published {
                diff_s,
                ..p
            }))),
            Err(Error::Conflict(why)) if why.starts_with(LOST_RACE) => {
                // Another writer took the version: the full publish resyncs
                // and writes an anchor after the bucket's newest version.
                tracing::warn!(version = next, "lost the commit race; publishing in full");
                self.snapshot = None;
                full(why)
            }
            Err(e) => Err(e),
        }
    }
}

/// What differs between the snapshot's file and the tensors given for it
/// (names, dtypes, shapes); `None` when they match.
fn structure_differs(
    base: &crate::tensors::TensorSet,
    given: &[ChangedTensor<'_>],
) -> Option<String> {
    if given.len() != base.len() {
        return Some(format!(
            "{} tensors given, the last version has {}",
            given.len(),
            base.len()
        ));
    }
    for t in given {
        let Some(i) = base.position(&t.name) else {
            return Some(format!("tensor `{}` is not in the last version", t.name));
        };
        let held = &base.tensors()[i];
        if held.dtype != t.dtype || held.shape != t.shape {
            return Some(format!(
                "tensor `{}` is {} {:?}, {} {:?} in the last version",
                t.name, t.dtype, t.shape, held.dtype, held.shape
            ));
        }
    }
    None
}
