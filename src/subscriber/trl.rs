//! Following a bucket in TRL's own layout (docs/format.md §11): what
//! `subscribe` does when the bucket holds `anchors/step_*.safetensors` and no
//! commit manifests. The replay itself is [`crate::protocol::trl::catch_up`]
//! (newest anchor, then the deltas after it in step order, every check TRL's
//! format allows); this module materializes the result like any single-file
//! checkpoint:
//!
//! ```text
//! DIR/current -> trl/step_NNNNNN      symlink, switched atomically per step
//! DIR/trl/step_NNNNNN/model.safetensors
//! DIR/.trl-state.json                 the step held and its digests
//! ```
//!
//! TRL's format has no commit protocol and no checksums, and a TRL receiver
//! keeps a full copy of the model in memory; so does this follower (the
//! weightcast layout's A/B slots and bounded memory need weightcast's
//! manifests). Each step is written whole into a fresh directory, fsynced,
//! then `current` switches; the previous step's directory goes after.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::codec::trl::version_of_step;
use crate::error::{Error, Result};
use crate::protocol::trl::{TrlReplica, catch_up as trl_catch_up};
use crate::store::Store;
use crate::tensors::{Digests, TensorSet};

use super::CaughtUp;

/// The file a TRL step is materialized as.
pub const FILE: &str = "model.safetensors";
const STATE: &str = ".trl-state.json";

#[derive(Debug, Serialize, Deserialize)]
struct State {
    step: u64,
    digest: String,
}

/// A follower of a TRL bucket into an output directory.
#[derive(Debug)]
pub struct TrlFollower {
    out: PathBuf,
    held: Option<TrlReplica>,
}

fn io_err(what: &str, p: &Path, e: std::io::Error) -> Error {
    Error::io(format!("{what} {}", p.display()), e)
}

impl TrlFollower {
    /// Whether `out` is a TRL follower's output (it has a TRL state).
    pub fn is_output(out: &Path) -> bool {
        out.join(STATE).exists()
    }

    /// Opens the output, loading and checking the step it holds (a file that
    /// does not match the recorded digest is dropped: the next catch-up
    /// starts from an anchor).
    pub fn open(out: &Path) -> Result<TrlFollower> {
        std::fs::create_dir_all(out).map_err(|e| io_err("creating", out, e))?;
        let held = Self::load(out);
        Ok(TrlFollower {
            out: out.to_path_buf(),
            held,
        })
    }

    fn load(out: &Path) -> Option<TrlReplica> {
        let state: State = serde_json::from_slice(&std::fs::read(out.join(STATE)).ok()?).ok()?;
        let path = out.join("current").join(FILE);
        let tensors = TensorSet::read(&path, Digests::Compute).ok()?;
        if tensors.digest().to_string() != state.digest {
            tracing::warn!(path = %path.display(), "the materialized TRL step does not verify; starting from an anchor");
            return None;
        }
        Some(TrlReplica {
            step: state.step,
            tensors,
        })
    }

    /// The step held, if any.
    pub fn step(&self) -> Option<u64> {
        self.held.as_ref().map(|r| r.step)
    }

    /// The directory `current` points to.
    pub fn current_dir(&self) -> PathBuf {
        self.out.join("current")
    }

    /// Catches up with the bucket; `None` when it holds no step yet.
    pub async fn catch_up(&mut self, store: &Store) -> Result<Option<CaughtUp>> {
        let before = self.step();
        let report = trl_catch_up(store, &mut self.held).await?;
        let Some(held) = &self.held else {
            return Ok(None);
        };
        let version = version_of_step(held.step).unwrap_or(0);
        let Some(r) = report else {
            return Ok(Some(CaughtUp {
                version,
                previous: before.and_then(version_of_step),
                ..CaughtUp::default()
            }));
        };
        let written = self.materialize(held)?;
        Ok(Some(CaughtUp {
            version,
            previous: r.previous.and_then(version_of_step),
            downloaded: r.downloaded,
            deltas_applied: r.deltas_applied,
            from_anchor: r.from_anchor,
            changed_tensors: r.changed_tensors,
            written_bytes: written,
            ..CaughtUp::default()
        }))
    }

    /// Writes the held step into a fresh directory and switches `current`.
    fn materialize(&self, held: &TrlReplica) -> Result<u64> {
        let dirs = self.out.join("trl");
        let name = format!("step_{:06}", held.step);
        let dir = dirs.join(&name);
        let tmp = dirs.join(format!("{name}.partial"));
        let _ = std::fs::remove_dir_all(&tmp);
        std::fs::create_dir_all(&tmp).map_err(|e| io_err("creating", &tmp, e))?;
        let path = tmp.join(FILE);
        let file = std::fs::File::create(&path).map_err(|e| io_err("creating", &path, e))?;
        let mut w = std::io::BufWriter::with_capacity(8 << 20, file);
        // A plain checkpoint: TRL's and weightcast's keys describe the
        // objects, not the weights.
        let meta = [("format".to_string(), "pt".to_string())].into();
        held.tensors.write_to(&meta, &mut w)?;
        let file = w
            .into_inner()
            .map_err(|e| io_err("writing", &path, e.into_error()))?;
        file.sync_all().map_err(|e| io_err("syncing", &path, e))?;
        let written = file
            .metadata()
            .map_err(|e| io_err("reading", &path, e))?
            .len();
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::rename(&tmp, &dir).map_err(|e| io_err("renaming", &tmp, e))?;
        sync(&dirs)?;
        let link = self.out.join("current");
        let link_tmp = self.out.join(".current.tmp");
        let _ = std::fs::remove_file(&link_tmp);
        std::os::unix::fs::symlink(Path::new("trl").join(&name), &link_tmp)
            .map_err(|e| io_err("linking", &link_tmp, e))?;
        std::fs::rename(&link_tmp, &link).map_err(|e| io_err("switching", &link, e))?;
        sync(&self.out)?;
        let state = State {
            step: held.step,
            digest: held.tensors.digest().to_string(),
        };
        crate::fsio::write_atomic(
            &self.out.join(STATE),
            &serde_json::to_vec_pretty(&state).expect("state serializes"),
        )?;
        // Older steps go once nothing points at them.
        if let Ok(entries) = std::fs::read_dir(&dirs) {
            for e in entries.flatten() {
                if e.file_name().to_str() != Some(name.as_str()) {
                    let _ = std::fs::remove_dir_all(e.path());
                }
            }
        }
        Ok(written)
    }
}

fn sync(p: &Path) -> Result<()> {
    std::fs::File::open(p)
        .and_then(|d| d.sync_all())
        .map_err(|e| io_err("syncing directory", p, e))
}
