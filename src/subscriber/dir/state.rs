//! The output directory's record: `DIR/.state.json` (per slot: version,
//! dirty flag, each file's layout, digests, BLAKE3 and stat stamp; the
//! journal's versions), and the full verification of a slot against it.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::digest::Digest;
use crate::error::{Error, Result};
use crate::fsio::{Stamp, write_atomic_after};
use crate::tensors::{Digests, TensorSet};

/// Value of the state's `format`.
pub const STATE_FORMAT: &str = "weightcast-subscriber-state/2";

/// `DIR/.state.json`.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct DirState {
    pub(super) format: String,
    pub(super) slots: BTreeMap<String, SlotState>,
    /// Versions whose manifests and objects are in `.journal/`, ascending.
    #[serde(default)]
    pub(super) journal: Vec<u64>,
}

impl DirState {
    fn path(out: &Path) -> PathBuf {
        out.join(".state.json")
    }

    /// Reads `DIR/.state.json`: an empty state when it is absent, unreadable
    /// or of another format (nothing is trusted then).
    pub(super) fn load(out: &Path) -> DirState {
        let mut state: DirState = std::fs::read(Self::path(out))
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .filter(|s: &DirState| s.format == STATE_FORMAT)
            .unwrap_or_default();
        state.format = STATE_FORMAT.to_string();
        state
    }

    /// Writes `DIR/.state.json` durably and atomically, later than every
    /// stamp it records ([`write_atomic_after`]).
    pub(super) fn save(&self, out: &Path) -> Result<()> {
        let body = serde_json::to_vec_pretty(self)
            .map_err(|e| Error::metadata("state", format!("cannot serialize: {e}")))?;
        let newest = self.slots.values().map(SlotState::newest_ctime).max();
        write_atomic_after(&Self::path(out), &body, newest.unwrap_or(0))
    }

    /// The file the stamps are recorded in ([`SlotState::trusted`]).
    pub(super) fn record(out: &Path) -> PathBuf {
        Self::path(out)
    }
}

/// What a slot holds.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct SlotState {
    /// The version its files hold (`None`: nothing usable).
    pub(super) version: Option<u64>,
    /// Set before the slot is written, cleared once it holds `version` durably.
    pub(super) dirty: bool,
    /// Tensor files.
    pub(super) tensors: BTreeMap<String, TensorFile>,
    /// Non-tensor files.
    pub(super) files: BTreeMap<String, PlainFile>,
}

/// A safetensors file of a slot.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct TensorFile {
    pub(super) size: u64,
    /// Offset of the tensor data (8 + header length).
    pub(super) data_start: u64,
    /// BLAKE3 of the bytes before the data (length and header).
    pub(super) header_blake3: String,
    pub(super) stamp: Stamp,
    /// Tensor name → its bytes in the file and its digest.
    pub(super) tensors: BTreeMap<String, TensorSlot>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct TensorSlot {
    pub(super) digest: String,
    pub(super) start: u64,
    pub(super) end: u64,
}

/// A non-tensor file of a slot.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct PlainFile {
    pub(super) size: u64,
    pub(super) blake3: String,
    pub(super) stamp: Stamp,
}

impl SlotState {
    pub(super) fn names(&self) -> BTreeSet<String> {
        self.tensors
            .keys()
            .chain(self.files.keys())
            .cloned()
            .collect()
    }

    /// Non-tensor files as (size, BLAKE3).
    pub(super) fn plain(&self) -> BTreeMap<String, (u64, String)> {
        self.files
            .iter()
            .map(|(n, f)| (n.clone(), (f.size, f.blake3.clone())))
            .collect()
    }

    fn stamps(&self) -> impl Iterator<Item = (&String, u64, Stamp)> {
        self.tensors
            .iter()
            .map(|(n, t)| (n, t.size, t.stamp))
            .chain(self.files.iter().map(|(n, f)| (n, f.size, f.stamp)))
    }

    /// The newest change time among the recorded stamps.
    pub(super) fn newest_ctime(&self) -> i64 {
        self.stamps().map(|(_, _, s)| s.ctime_ns).max().unwrap_or(0)
    }

    /// Whether the slot can be trusted without reading it: every file is as
    /// recorded by its stamp (size, inode, modification and change times),
    /// recorded before `record` was written ([`Stamp::older_than`]: not
    /// racily), each tensor file's header bytes hash as recorded, and the
    /// slot holds no other file. A change through the kernel shows in a
    /// stamp; the checks each version makes in proportion to its changes
    /// (digests) and `weightcast verify` are what see the rest.
    pub(super) fn trusted(&self, dir: &Path, record: &Path) -> bool {
        for (n, size, stamp) in self.stamps() {
            if Stamp::of(&dir.join(n)) != Some((size, stamp)) || !stamp.older_than(record) {
                return false;
            }
        }
        for (n, t) in &self.tensors {
            if header_blake3(&dir.join(n), t.data_start.min(t.size)).as_deref()
                != Some(t.header_blake3.as_str())
            {
                return false;
            }
        }
        list_files(dir).is_ok_and(|l| l == self.names())
    }

    /// Records the stamps of the files as they are now.
    pub(super) fn restamp(&mut self, dir: &Path) -> Result<()> {
        let stamp = |n: &str| {
            Stamp::of(&dir.join(n)).map(|(_, s)| s).ok_or_else(|| {
                Error::io(
                    format!("reading {}", dir.join(n).display()),
                    std::io::Error::from(std::io::ErrorKind::NotFound),
                )
            })
        };
        for (n, t) in &mut self.tensors {
            t.stamp = stamp(n)?;
        }
        for (n, f) in &mut self.files {
            f.stamp = stamp(n)?;
        }
        Ok(())
    }
}

impl TensorFile {
    /// The record of `set`, mapped from a file of `size` bytes whose bytes
    /// before the data hash to `header_blake3`.
    pub(super) fn of(set: &TensorSet, size: u64, header_blake3: String) -> TensorFile {
        let data_start = set.tensors().iter().map(|t| t.range.start as u64).min();
        TensorFile {
            size,
            data_start: data_start.unwrap_or(size),
            header_blake3,
            stamp: Stamp::default(),
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

    /// Whether `set` (parsed from this file) has the recorded layout.
    pub(super) fn same_layout(&self, set: &TensorSet) -> bool {
        set.len() == self.tensors.len()
            && set.tensors().iter().all(|t| {
                self.tensors
                    .get(&t.name)
                    .is_some_and(|s| (s.start, s.end) == (t.range.start as u64, t.range.end as u64))
            })
    }

    /// The recorded digests, in the set's tensor order.
    pub(super) fn digests(&self, set: &TensorSet) -> Option<Vec<Digest>> {
        set.tensors()
            .iter()
            .map(|t| Digest::parse(&self.tensors.get(&t.name)?.digest))
            .collect()
    }
}

/// Every regular file under `dir`, as relative paths (directories walked,
/// symlinks and other entries counted as files so that they never verify).
fn list_files(dir: &Path) -> std::io::Result<BTreeSet<String>> {
    let mut out = BTreeSet::new();
    let mut todo = vec![PathBuf::new()];
    while let Some(rel) = todo.pop() {
        for e in std::fs::read_dir(dir.join(&rel))? {
            let e = e?;
            let name = rel.join(e.file_name());
            if e.file_type()?.is_dir() {
                todo.push(name);
            } else {
                out.insert(name.to_string_lossy().into_owned());
            }
        }
    }
    Ok(out)
}

/// BLAKE3 of the first `len` bytes of the file at `p` (a tensor file's
/// length and header).
fn header_blake3(p: &Path, len: u64) -> Option<String> {
    let f = std::fs::File::open(p).ok()?;
    let mut b = vec![0u8; usize::try_from(len).ok()?];
    std::os::unix::fs::FileExt::read_exact_at(&f, &mut b, 0).ok()?;
    Some(blake3::hash(&b).to_hex().to_string())
}

/// Checks a slot's files against its record, reading every byte: the
/// listing, each tensor file's header bytes, layout and every tensor digest
/// (over a read-only mapping, in parallel), each other file's BLAKE3.
pub(super) fn verify_slot(dir: &Path, rec: &SlotState) -> std::result::Result<(), String> {
    let listed = list_files(dir).map_err(|e| format!("listing {}: {e}", dir.display()))?;
    if listed != rec.names() {
        return Err(format!(
            "holds files {listed:?}, the state records {:?}",
            rec.names()
        ));
    }
    for (name, t) in &rec.tensors {
        let p = dir.join(name);
        let set = TensorSet::map(&p, false, Digests::Skip).map_err(|e| e.to_string())?;
        let size = Stamp::of(&p).map(|(s, _)| s);
        if size != Some(t.size) || !t.same_layout(&set) {
            return Err(format!("{name}: size or layout differs from the state"));
        }
        if header_blake3(&p, t.data_start.min(t.size)).as_deref() != Some(t.header_blake3.as_str())
        {
            return Err(format!("{name}: header differs from the state"));
        }
        let want = t
            .digests(&set)
            .ok_or(format!("{name}: bad digest in the state"))?;
        if set.full_digests() != want {
            return Err(format!("{name}: tensor digests differ from the state"));
        }
    }
    for (name, f) in &rec.files {
        let p = dir.join(name);
        let mut h = blake3::Hasher::new();
        h.update_mmap_rayon(&p)
            .map_err(|e| format!("{name}: {e}"))?;
        let size = Stamp::of(&p).map(|(s, _)| s);
        if size != Some(f.size) || h.finalize().to_hex().as_str() != f.blake3 {
            return Err(format!("{name}: content differs from the state"));
        }
    }
    Ok(())
}
