//! The output directory's journal: the verified delta and file objects of
//! the versions applied recently, with their manifests, kept so that a slot
//! which missed them is brought forward without downloading anything.
//!
//! ```text
//! DIR/.journal/<version:020>.json      the manifest of a version applied recently
//! DIR/.journal/<version:020>/<name>    its verified delta and file objects
//! DIR/.journal/<version:020>.ctx/<name> the `compact2` context its delta for tensor file <name> made
//! ```
//!
//! A context (docs/format.md §6.3) is what the next delta of its file is
//! coded against; a delta names the version whose context it needs, so a
//! slot brought forward from an older version finds each one here.
//!
//! Objects are written as they are applied (not synced: each is checked
//! against its manifest entry, size and BLAKE3, when it is replayed); the
//! state lists the versions the journal holds, and pruning keeps those some
//! slot other than the current one still needs.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use crate::codec::Context;
use crate::error::{Error, Result};
use crate::fsio::io_err;
use crate::protocol::{Manifest, ObjectEntry};

use super::state::DirState;

/// What replaying one version of the journal hands its caller, in order.
pub(super) enum Replayed<'a> {
    /// One of the version's delta or file objects, checked against its
    /// manifest entry.
    Object(&'a ObjectEntry, &'a [u8]),
    /// Every object of the version was handed over.
    Done(&'a Manifest),
}

/// `DIR/.journal/`.
pub(super) struct Journal {
    dir: PathBuf,
}

impl Journal {
    /// The journal of the output directory `out`.
    pub(super) fn of(out: &Path) -> Journal {
        Journal {
            dir: out.join(".journal"),
        }
    }

    /// Writes an object of a downloaded version into the journal (not
    /// synced: journal objects are checked against their manifest when used).
    pub(super) fn object(&self, version: u64, name: &str, body: &[u8]) -> Result<()> {
        let p = self.dir.join(format!("{version:020}")).join(name);
        if let Some(parent) = p.parent() {
            std::fs::create_dir_all(parent).map_err(|e| io_err("creating", parent, e))?;
        }
        std::fs::write(&p, body).map_err(|e| io_err("writing", &p, e))
    }

    fn context_path(&self, version: u64, name: &str) -> PathBuf {
        self.dir.join(format!("{version:020}.ctx")).join(name)
    }

    /// Keeps the context applying version `version`'s delta object for
    /// tensor file `name` made (not synced: a context is checked whole, and
    /// against what the delta records, when it is read).
    pub(super) fn save_context(&self, version: u64, name: &str, c: &Context) -> Result<()> {
        let p = self.context_path(version, name);
        if let Some(parent) = p.parent() {
            std::fs::create_dir_all(parent).map_err(|e| io_err("creating", parent, e))?;
        }
        std::fs::write(&p, c.to_bytes()).map_err(|e| io_err("writing", &p, e))
    }

    /// The context [`Journal::save_context`] kept for `version` and file
    /// `name`, if it is there and reads back whole.
    pub(super) fn context(&self, version: u64, name: &str) -> Option<Context> {
        let p = self.context_path(version, name);
        let bytes = std::fs::read(&p).ok()?;
        Context::from_bytes(&bytes)
            .inspect_err(
                |e| tracing::warn!(path = %p.display(), error = %e, "journal context dropped"),
            )
            .ok()
    }

    /// Writes the manifest of a version whose objects are journaled.
    pub(super) fn manifest(&self, m: &Manifest) -> Result<()> {
        let p = self.dir.join(format!("{:020}.json", m.version));
        let body = serde_json::to_vec_pretty(m).expect("manifest serializes");
        std::fs::create_dir_all(&self.dir)
            .and_then(|()| std::fs::write(&p, body))
            .map_err(|e| io_err("writing", &p, e))
    }

    /// Replays the journaled versions `from + 1 ..= to` in order, handing
    /// each object (its size and BLAKE3 checked against the manifest) and
    /// then the end of its version to `each`.
    pub(super) fn replay(
        &self,
        from: u64,
        to: u64,
        mut each: impl FnMut(u64, Replayed<'_>) -> Result<()>,
    ) -> Result<()> {
        for v in from + 1..=to {
            let key = format!("{v:020}.json");
            let p = self.dir.join(&key);
            let bytes = std::fs::read(&p).map_err(|e| io_err("reading", &p, e))?;
            let m = Manifest::parse(&bytes, &key)?;
            if m.version != v {
                return Err(Error::metadata(key, format!("holds version {}", m.version)));
            }
            for o in m.replay_objects() {
                let p = self.dir.join(format!("{v:020}")).join(&o.name);
                let body = std::fs::read(&p).map_err(|e| io_err("reading", &p, e))?;
                let hash = blake3::hash(&body).to_hex();
                if body.len() as u64 != o.size || hash.as_str() != o.blake3 {
                    return Err(Error::Integrity {
                        scope: format!("journal object {}", p.display()),
                        expected: o.blake3.clone(),
                        actual: hash.to_string(),
                    });
                }
                each(v, Replayed::Object(o, &body))?;
            }
            each(v, Replayed::Done(&m))?;
        }
        Ok(())
    }

    /// Keeps the versions some slot other than `current` still needs (those
    /// after the oldest clean one's version) in `state` and on disk, with
    /// the contexts of those, of that oldest version and of the current
    /// slot's; removes the rest.
    pub(super) fn prune(&self, state: &mut DirState, current: Option<&str>) {
        let oldest = state
            .slots
            .iter()
            .filter(|(n, s)| Some(n.as_str()) != current && !s.dirty)
            .filter_map(|(_, s)| s.version)
            .min();
        state.journal.retain(|&v| oldest.is_some_and(|o| v > o));
        let held = current
            .and_then(|c| state.slots.get(c))
            .and_then(|s| s.version);
        let keep: BTreeSet<String> = state
            .journal
            .iter()
            .flat_map(|v| {
                [
                    format!("{v:020}"),
                    format!("{v:020}.json"),
                    format!("{v:020}.ctx"),
                ]
            })
            .chain(
                oldest
                    .iter()
                    .chain(held.iter())
                    .map(|v| format!("{v:020}.ctx")),
            )
            .collect();
        if let Ok(entries) = std::fs::read_dir(&self.dir) {
            for e in entries.flatten() {
                if !keep.contains(&*e.file_name().to_string_lossy()) {
                    let p = e.path();
                    let _ = std::fs::remove_dir_all(&p).or_else(|_| std::fs::remove_file(&p));
                }
            }
        }
    }
}
