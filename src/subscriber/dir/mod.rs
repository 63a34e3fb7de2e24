//! [`DirSink`]: the output directory, as alternating slots patched in place.
//!
//! ```text
//! DIR/current -> slots/<name>          symlink, switched atomically (rename of a new symlink)
//! DIR/slots/<a|b|...>/<files>          the checkpoint's own file names, in each slot
//! DIR/.state.json                      per slot: version, dirty flag, per-file layout, digests, BLAKE3s
//! DIR/.journal/<version:020>.json      the manifest of a version applied recently
//! DIR/.journal/<version:020>/<name>    its verified delta and file objects
//! DIR/.journal/<version:020>.ctx/<name> the `compact2` context its delta for <name> made
//! DIR/.tmp/                            anchors being downloaded
//! DIR/.lock                            held (flock) while a subscriber uses DIR
//! ```
//!
//! The slot `current` points to is never written. A new version is produced
//! in the oldest other slot: it is marked dirty (state fsynced), brought
//! forward to the held version by applying the journal's objects (nothing
//! downloaded), the new version's deltas are applied to its files in place
//! through a shared memory map (no copy of the model; memory in proportion to
//! the changes), files the version no longer lists are removed, everything is
//! flushed (msync, fsync), the slot's version is recorded and its dirty flag
//! cleared (state fsynced), and `current` is switched to it. A slot found
//! dirty, or whose files changed behind the state's back (size, inode, times),
//! or which the journal cannot bring forward, is rebuilt: cloned from the
//! current slot (a reflink where the filesystem shares extents), then brought
//! forward. A bootstrap downloads each anchor into `.tmp/`, verifies it, turns
//! its header into the output header in place and renames it into the slot.
//!
//! Output files are plain safetensors files Hugging Face loaders accept: the
//! anchor's `__metadata__` without the `weightcast.*` keys (so `format=pt` and
//! the trainer's own keys), the header padded with spaces (which safetensors
//! allows) to the anchor's header length, so the data never moves.
//!
//! With N slots, files an engine opened for a version stay untouched until N−1
//! newer versions have been switched in.
//!
//! This file holds the sink and its slots; `state` the record
//! (`.state.json`) and the full verification of a slot against it;
//! `journal` the journal's objects, their replay and pruning.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use crate::codec::ApplyReport;
use crate::digest::Digest;
use crate::dtype::Dtype;
use crate::error::{Error, Result};
use crate::fsio::{io_err, sync_dir, sync_file};
use crate::protocol::{Manifest, ObjectRole, is_safe_file_name};
use crate::tensors::{Digests, TensorSet, safetensors_header};

use super::sink::{
    AnchorDest, AnchorObject, Produced, Sink, apply_checked, check_version, decode_anchor,
    output_metadata, patched_bytes,
};

mod journal;
mod state;

use crate::fsio::Stamp;
use journal::{Journal, Replayed};
pub use state::STATE_FORMAT;
use state::{DirState, PlainFile, SlotState, TensorFile, verify_slot};

/// Default number of slots.
pub const DEFAULT_SLOTS: usize = 2;
/// Most slots a directory may have (named `a` to `z`).
pub const MAX_SLOTS: usize = 26;

/// Every directory under `dir` (itself included), deepest first.
fn list_dirs(dir: &Path) -> std::io::Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d)? {
            let e = e?;
            if e.file_type()?.is_dir() {
                todo.push(e.path());
            }
        }
        out.push(d);
    }
    out.reverse();
    Ok(out)
}

/// The output header for `set` (in its file's order) with `metadata`, padded
/// with spaces to exactly `len` bytes; `None` if it does not fit.
fn padded_header(
    set: &TensorSet,
    metadata: &BTreeMap<String, String>,
    len: usize,
) -> Result<Option<Vec<u8>>> {
    let mut order: Vec<usize> = (0..set.len()).collect();
    order.sort_by_key(|&i| set.tensors()[i].range.start);
    let views: Vec<(&str, Dtype, &[usize], &[u8])> = order
        .iter()
        .map(|&i| {
            let t = &set.tensors()[i];
            (t.name.as_str(), t.dtype, t.shape.as_slice(), set.data(i))
        })
        .collect();
    let mut h = safetensors_header(&views, metadata)?;
    if h.len() > len {
        return Ok(None);
    }
    h.resize(len, b' ');
    Ok(Some(h))
}

/// A file of the update that must be synced before the slot is recorded.
#[derive(Debug, Default)]
struct Work {
    slot: String,
    dir: PathBuf,
    /// The slot as it is being built (`version`: reached so far).
    rec: SlotState,
    /// Tensor files mapped for writing.
    open: BTreeMap<String, TensorSet>,
    /// Tensor files given an object in the version being applied.
    touched: BTreeSet<String>,
    /// Whether the version being applied is a bootstrap's anchor version.
    bootstrap: bool,
    /// Versions journaled by this update (downloaded, not replayed from the journal).
    journaled: Vec<u64>,
    /// The journal restarts (a bootstrap: older versions cannot reach this slot).
    journal_reset: bool,
    /// Files written other than through a mapping, to sync.
    to_sync: BTreeSet<PathBuf>,
    produced: Produced,
    tmp_files: u64,
}

/// What `weightcast verify --out` found in one slot.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct SlotReport {
    /// The slot's name (`a`, `b`, …).
    pub slot: String,
    /// The version the state recorded it clean at (`None`: nothing usable).
    pub version: Option<u64>,
    /// Whether `current` points to it.
    pub current: bool,
    /// Whether it verified (a slot holding nothing verifies trivially).
    pub ok: bool,
    /// Why not.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// The output directory (see the module documentation).
#[derive(Debug)]
pub struct DirSink {
    out: PathBuf,
    names: Vec<String>,
    state: DirState,
    /// The slot `current` points to (verified when `held` is set).
    current: Option<String>,
    held: Option<u64>,
    damaged: bool,
    finished_switch: bool,
    /// Each slot's tensor files, still mapped from the update that last
    /// wrote them (flushed): the next update of that slot reuses them, so
    /// that its pages are not faulted in again (on tmpfs they stay
    /// writable) and a 2 GB mapping is not torn down per version.
    maps: BTreeMap<String, BTreeMap<String, TensorSet>>,
    work: Option<Work>,
    _lock: std::fs::File,
}

impl DirSink {
    /// Opens (creating) the output directory `out` with `slots` slots: takes
    /// its lock, loads the state, and checks the current slot: trusted when
    /// every file's stamp is the one recorded (`SlotState::trusted`: size,
    /// inode, modification and change times, header bytes), verified in full
    /// otherwise (a digest pass over every byte; damage means nothing is
    /// held, so the next update bootstraps into another slot). A switch
    /// interrupted by a crash (a newer slot recorded clean) is finished here,
    /// after that slot checks out. [`DirSink::verify`] verifies in full
    /// whatever the stamps say.
    pub fn open(out: &Path, slots: usize) -> Result<DirSink> {
        Self::open_with(out, slots, false)
    }

    fn open_with(out: &Path, slots: usize, full: bool) -> Result<DirSink> {
        if !(2..=MAX_SLOTS).contains(&slots) {
            return Err(Error::Config(format!(
                "--slots {slots}: between 2 and {MAX_SLOTS} output slots"
            )));
        }
        let slots_dir = out.join("slots");
        std::fs::create_dir_all(&slots_dir).map_err(|e| io_err("creating", &slots_dir, e))?;
        let lock_path = out.join(".lock");
        let lock =
            std::fs::File::create(&lock_path).map_err(|e| io_err("creating", &lock_path, e))?;
        lock.try_lock().map_err(|_| {
            Error::Config(format!(
                "{} is in use by another subscriber (its lock {} is held); give each subscriber its own --out",
                out.display(),
                lock_path.display()
            ))
        })?;
        let names: Vec<String> = (0..slots)
            .map(|i| char::from(b'a' + i as u8).to_string())
            .collect();
        let mut state = DirState::load(out);
        // Whatever `current` points to is never written, recorded or not (an
        // engine may be reading it): without a record it is merely untrusted.
        let current = std::fs::read_link(out.join("current")).ok().and_then(|t| {
            let rest = t.strip_prefix("slots").ok()?.to_str()?.to_string();
            (rest.len() == 1 && rest.bytes().all(|b| b.is_ascii_lowercase())).then_some(rest)
        });
        if let Some(c) = &current {
            state.slots.entry(c.clone()).or_default();
        }
        // Slots beyond the configured count go, unless current.
        let extra: Vec<String> = state
            .slots
            .keys()
            .filter(|n| !names.contains(n) && Some(*n) != current.as_ref())
            .cloned()
            .collect();
        for n in extra {
            state.slots.remove(&n);
            let _ = std::fs::remove_dir_all(slots_dir.join(&n));
        }
        // Names that are not slots of this state (older runs, strays).
        if let Ok(entries) = std::fs::read_dir(&slots_dir) {
            for e in entries.flatten() {
                let n = e.file_name().to_string_lossy().into_owned();
                if !names.contains(&n) && Some(&n) != current.as_ref() {
                    let _ = std::fs::remove_dir_all(e.path());
                }
            }
        }
        for n in &names {
            state.slots.entry(n.clone()).or_default();
            let d = slots_dir.join(n);
            std::fs::create_dir_all(&d).map_err(|e| io_err("creating", &d, e))?;
        }
        let _ = std::fs::remove_dir_all(out.join(".tmp"));
        let mut sink = DirSink {
            out: out.to_path_buf(),
            names,
            state,
            current,
            held: None,
            damaged: false,
            finished_switch: false,
            maps: BTreeMap::new(),
            work: None,
            _lock: lock,
        };
        sink.verify_current(full)?;
        Ok(sink)
    }

    /// `weightcast verify --out`: opens the output directory (its lock
    /// taken, a switch a crash interrupted finished) and verifies every slot
    /// the state records clean in full, whatever its stamps say — the
    /// listing, each header, every tensor digest, every file's BLAKE3. A slot
    /// that does not verify is recorded as holding nothing: it is rebuilt
    /// before it is written again, and a damaged current slot is replaced by
    /// the next update (a bootstrap into another slot). Nothing is
    /// downloaded.
    pub fn verify(out: &Path) -> Result<Vec<SlotReport>> {
        if !out.join(".state.json").is_file() {
            return Err(Error::Config(format!(
                "{} is not a subscriber's output directory (no .state.json): pass the --out \
                 of a subscriber",
                out.display()
            )));
        }
        let before = DirState::load(out);
        let slots = before.slots.len().clamp(2, MAX_SLOTS);
        let mut sink = Self::open_with(out, slots, true)?;
        let mut reports = Vec::new();
        let names: Vec<String> = sink.state.slots.keys().cloned().collect();
        for name in names {
            let current = sink.current.as_deref() == Some(name.as_str());
            let rec = sink.state.slots[&name].clone();
            let mut report = SlotReport {
                slot: name.clone(),
                version: before
                    .slots
                    .get(&name)
                    .filter(|s| !s.dirty)
                    .and_then(|s| s.version),
                current,
                ok: true,
                error: None,
            };
            if current {
                // Verified in full by the open: held, or found damaged.
                if sink.held.is_none() {
                    report.ok = false;
                    report.error = Some("does not verify; the next update replaces it".into());
                }
            } else if rec.version.is_some() && !rec.dirty {
                let dir = sink.slot_dir(&name);
                if let Err(why) = verify_slot(&dir, &rec) {
                    tracing::warn!(slot = %name, %why, "output slot does not verify; it will be rebuilt");
                    sink.state.slots.insert(name.clone(), SlotState::default());
                    sink.save_state()?;
                    report.ok = false;
                    report.error = Some(why);
                } else {
                    let mut rec = rec;
                    rec.restamp(&dir)?;
                    sink.state.slots.insert(name.clone(), rec);
                    sink.save_state()?;
                }
            }
            reports.push(report);
        }
        Ok(reports)
    }

    /// Checks the current slot — or, when a crash interrupted a switch, the
    /// newer clean slot, and switches to it: trusted by its stamps
    /// ([`SlotState::trusted`]) unless `full`, verified in full otherwise.
    fn verify_current(&mut self, full: bool) -> Result<()> {
        let cur_version = self
            .current
            .as_ref()
            .and_then(|c| self.state.slots[c].version);
        let newer = self
            .state
            .slots
            .iter()
            .filter(|(n, s)| Some(*n) != self.current.as_ref() && !s.dirty)
            .filter_map(|(n, s)| Some((s.version?, n.clone())))
            .filter(|&(v, _)| cur_version.is_none_or(|c| v > c))
            .max();
        let mut candidates: Vec<String> = newer.into_iter().map(|(_, n)| n).collect();
        candidates.extend(self.current.clone());
        let had_current = self.current.is_some();
        for name in candidates {
            let rec = &self.state.slots[&name];
            let Some(version) = rec.version.filter(|_| !rec.dirty) else {
                continue;
            };
            let dir = self.slot_dir(&name);
            let trusted = !full && rec.trusted(&dir, &DirState::record(&self.out));
            let checked = if trusted {
                Ok(())
            } else {
                verify_slot(&dir, rec)
            };
            match checked {
                Ok(()) => {
                    if !trusted {
                        // Verified: its stamps as they are now, so that the
                        // next start trusts it.
                        let mut rec = rec.clone();
                        rec.restamp(&dir)?;
                        self.state.slots.insert(name.clone(), rec);
                        self.save_state()?;
                    }
                    if self.current.as_ref() != Some(&name) {
                        tracing::info!(slot = %name, version, "finishing a switch a crash interrupted");
                        self.save_state()?;
                        self.switch(&name)?;
                        self.finished_switch = true;
                    }
                    self.held = Some(version);
                    return Ok(());
                }
                Err(why) => {
                    tracing::warn!(slot = %name, version, %why, "output slot does not verify; it will be rebuilt");
                    self.state.slots.insert(name.clone(), SlotState::default());
                    self.save_state()?;
                }
            }
        }
        self.damaged = had_current;
        Ok(())
    }

    /// The output directory.
    pub fn out(&self) -> &Path {
        &self.out
    }

    /// The directory engines load: `DIR/current`.
    pub fn current_dir(&self) -> PathBuf {
        self.out.join("current")
    }

    /// Whether opening found the current slot damaged (it will be replaced
    /// by a bootstrap into another slot).
    pub fn found_damaged(&self) -> bool {
        self.damaged
    }

    /// Whether opening finished a switch a crash had interrupted (`current`
    /// moved to a newer version then: engines have not been told yet).
    pub fn finished_switch(&self) -> bool {
        self.finished_switch
    }

    /// The slot `current` points to.
    pub fn current_slot(&self) -> Option<&str> {
        self.current.as_deref()
    }

    fn slot_dir(&self, name: &str) -> PathBuf {
        self.out.join("slots").join(name)
    }

    fn journal(&self) -> Journal {
        Journal::of(&self.out)
    }

    fn save_state(&self) -> Result<()> {
        self.state.save(&self.out)
    }

    /// Points `current` at slot `name` (a new symlink renamed over the old).
    fn switch(&mut self, name: &str) -> Result<()> {
        let link = self.out.join("current");
        let tmp = self.out.join(".current.tmp");
        let _ = std::fs::remove_file(&tmp);
        std::os::unix::fs::symlink(Path::new("slots").join(name), &tmp)
            .map_err(|e| io_err("linking", &tmp, e))?;
        std::fs::rename(&tmp, &link).map_err(|e| io_err("switching", &link, e))?;
        sync_dir(&self.out)?;
        self.current = Some(name.to_string());
        Ok(())
    }

    /// Whether the slot the next update writes holds no file at all: no
    /// engine can be reading it, so bringing it forward ([`Sink::prepare`])
    /// is safe even before an engine confirmed the current version.
    pub fn standby_is_empty(&self) -> bool {
        let dir = self.slot_dir(&self.next_slot());
        std::fs::read_dir(&dir).is_ok_and(|mut d| d.next().is_none())
    }

    /// The slot the next version is produced in: the oldest one that is not
    /// current (dirty and empty slots first).
    fn next_slot(&self) -> String {
        self.names
            .iter()
            .filter(|n| Some(*n) != self.current.as_ref())
            .min_by_key(|n| {
                let s = &self.state.slots[*n];
                s.version.filter(|_| !s.dirty).map_or(-1, |v| v as i128)
            })
            .cloned()
            .expect("at least two slots")
    }

    /// Brings the work slot to the held version `held`: from the journal
    /// when the slot is trustworthy and the journal covers the gap, otherwise
    /// by cloning the current slot.
    fn bring_forward(
        &mut self,
        work: &mut Work,
        held: u64,
        was_dirty: bool,
        mapped: BTreeMap<String, TensorSet>,
    ) -> Result<()> {
        let from = work.rec.version.filter(|_| !was_dirty);
        let journaled: BTreeSet<u64> = self.state.journal.iter().copied().collect();
        let usable = from.is_some_and(|v| {
            v <= held
                && (v + 1..=held).all(|x| journaled.contains(&x))
                && work.rec.trusted(&work.dir, &DirState::record(&self.out))
        });
        if usable {
            let v = from.expect("checked");
            // The files are as recorded (stamps): their mappings from the
            // last update of this slot are too.
            work.open = mapped;
            match self.replay_journal(work, v, held) {
                Ok(()) => return Ok(()),
                Err(e) => {
                    tracing::warn!(slot = %work.slot, error = %e, "journal replay failed; cloning the current slot");
                }
            }
        } else {
            tracing::info!(slot = %work.slot, version = ?from, held, "cloning the current slot");
        }
        self.clone_current(work)
    }

    fn replay_journal(&self, work: &mut Work, from: u64, to: u64) -> Result<()> {
        self.journal().replay(from, to, |v, r| match r {
            Replayed::Object(o, body) => {
                work.produced.journal_bytes += o.size;
                match o.role {
                    ObjectRole::Delta => {
                        Self::apply_to_slot(work, &self.journal(), v, &o.name, body).map(|_| ())
                    }
                    ObjectRole::File => Self::write_to_slot(work, &o.name, body),
                    ObjectRole::Anchor => Ok(()),
                }
            }
            Replayed::Done(m) => Self::finish_version(work, m),
        })
    }

    /// Rebuilds the work slot as a copy of the current one (reflinks where
    /// the filesystem can).
    fn clone_current(&self, work: &mut Work) -> Result<()> {
        work.open.clear();
        let cur = self
            .current
            .clone()
            .ok_or_else(|| Error::BadRequest("no current slot to clone from".to_string()))?;
        let src = self.slot_dir(&cur);
        let _ = std::fs::remove_dir_all(&work.dir);
        std::fs::create_dir_all(&work.dir).map_err(|e| io_err("creating", &work.dir, e))?;
        let rec = self.state.slots[&cur].clone();
        let pairs: Vec<(PathBuf, PathBuf)> = rec
            .names()
            .into_iter()
            .map(|name| (src.join(&name), work.dir.join(&name)))
            .collect();
        for (_, to) in &pairs {
            if let Some(parent) = to.parent() {
                std::fs::create_dir_all(parent).map_err(|e| io_err("creating", parent, e))?;
            }
        }
        // The files are copied side by side on the rayon pool: a copy
        // without reflinks is one kernel copy per file, on one core (a 2 GB
        // slot's four files took 1.25 s one after another on a 16-core host).
        let copied: Vec<Result<u64>> = {
            use rayon::prelude::*;
            pairs
                .par_iter()
                .with_max_len(1)
                .map(|(from, to)| {
                    reflink_copy::reflink_or_copy(from, to)
                        .map(|c| c.unwrap_or(0))
                        .map_err(|e| io_err("cloning", from, e))
                })
                .collect()
        };
        for ((_, to), copied) in pairs.into_iter().zip(copied) {
            let copied = copied?;
            work.produced.cloned_bytes += copied;
            work.produced.written_bytes += copied;
            work.to_sync.insert(to);
        }
        work.rec = rec;
        Ok(())
    }

    /// Maps tensor file `name` of the work slot for writing, with the
    /// recorded digests (checked layout; no pass over the data).
    fn open_mapped<'w>(work: &'w mut Work, name: &str) -> Result<&'w mut TensorSet> {
        if !work.open.contains_key(name) {
            let rec = work.rec.tensors.get(name).ok_or_else(|| {
                Error::metadata(
                    "manifest",
                    format!("delta for `{name}`, which the base does not have"),
                )
            })?;
            let p = work.dir.join(name);
            // A slot cloned by reflink shares its blocks with the current
            // slot until written: refuse, rather than die of SIGBUS on a
            // full disk half-way (see `fsio::room_to_rewrite`).
            if crate::fsio::shares_blocks(&work.dir) {
                let len = std::fs::metadata(&p)
                    .map_err(|e| io_err("reading", &p, e))?
                    .len();
                crate::fsio::room_to_rewrite(&p, len)?;
            }
            let mut set = TensorSet::map(&p, true, Digests::Skip)?;
            let digests = rec
                .digests(&set)
                .filter(|_| rec.same_layout(&set))
                .ok_or_else(|| Error::Integrity {
                    scope: format!("output file {}", p.display()),
                    expected: "the layout recorded in the state".into(),
                    actual: "another layout".into(),
                })?;
            set.assume_digests(&digests)?;
            work.open.insert(name.to_string(), set);
        }
        Ok(work.open.get_mut(name).expect("inserted above"))
    }

    fn apply_to_slot(
        work: &mut Work,
        journal: &Journal,
        version: u64,
        name: &str,
        delta: &[u8],
    ) -> Result<ApplyReport> {
        // A `compact2` delta names the version whose context it was coded
        // against (docs/format.md §6.3); the journal keeps it.
        let context = match crate::codec::inspect(delta) {
            Ok((_, Some(h))) => h.context.and_then(|c| journal.context(c.version, name)),
            _ => None,
        };
        let set = Self::open_mapped(work, name)?;
        let before = set.metadata().clone();
        let started = std::time::Instant::now();
        let (report, next) = apply_checked(set, delta, context.as_ref())?;
        if let Some(c) = next {
            journal.save_context(version, name, &c)?;
        }
        tracing::debug!(
            file = name,
            version,
            changed = report.changed,
            seconds = started.elapsed().as_secs_f64(),
            "applied in place"
        );
        // The delta carried the version's own `__metadata__` (a trainer's
        // step): the file's header takes it.
        let moved = *set.metadata() != before;
        work.produced.written_bytes += patched_bytes(set, delta);
        work.touched.insert(name.to_string());
        if moved {
            Self::write_metadata(work, name)?;
        }
        Ok(report)
    }

    /// Writes the header of output file `name` again with the metadata its
    /// mapped set now carries, padded with spaces to the same length (the
    /// data never moves; an output header has the room the anchor's
    /// weightcast keys took). Metadata that does not fit is not written: the
    /// file keeps the previous version's, with a warning.
    fn write_metadata(work: &mut Work, name: &str) -> Result<()> {
        let (Some(set), Some(rec)) = (work.open.get(name), work.rec.tensors.get_mut(name)) else {
            return Ok(());
        };
        let len = rec.data_start.saturating_sub(8) as usize;
        let Some(header) = padded_header(set, set.metadata(), len)? else {
            tracing::warn!(
                file = name,
                "the version's metadata does not fit in the output header; the file keeps the \
                 previous version's"
            );
            return Ok(());
        };
        let mut head = (header.len() as u64).to_le_bytes().to_vec();
        head.extend_from_slice(&header);
        let p = work.dir.join(name);
        std::fs::OpenOptions::new()
            .write(true)
            .open(&p)
            .and_then(|f| std::os::unix::fs::FileExt::write_all_at(&f, &head, 0))
            .map_err(|e| io_err("writing the header of", &p, e))?;
        rec.header_blake3 = blake3::hash(&head).to_hex().to_string();
        work.produced.written_bytes += head.len() as u64;
        work.to_sync.insert(p);
        Ok(())
    }

    fn write_to_slot(work: &mut Work, name: &str, body: &[u8]) -> Result<()> {
        let p = work.dir.join(name);
        if let Some(parent) = p.parent() {
            std::fs::create_dir_all(parent).map_err(|e| io_err("creating", parent, e))?;
        }
        std::fs::write(&p, body).map_err(|e| io_err("writing", &p, e))?;
        work.to_sync.insert(p);
        work.produced.written_bytes += body.len() as u64;
        work.rec.files.insert(
            name.to_string(),
            PlainFile {
                size: body.len() as u64,
                blake3: blake3::hash(body).to_hex().to_string(),
                stamp: Stamp::default(),
            },
        );
        Ok(())
    }

    fn remove_from_slot(work: &mut Work, name: &str) {
        work.open.remove(name);
        work.rec.tensors.remove(name);
        work.rec.files.remove(name);
        let p = work.dir.join(name);
        let _ = std::fs::remove_file(&p);
        // Empty directories the file leaves behind go too.
        let mut d = p.parent();
        while let Some(dir) = d.filter(|d| *d != work.dir) {
            if std::fs::remove_dir(dir).is_err() {
                break;
            }
            d = dir.parent();
        }
    }

    /// The end of one version in the work slot: checks it is complete and
    /// removes the files it no longer has.
    fn finish_version(work: &mut Work, m: &Manifest) -> Result<()> {
        if work.bootstrap {
            let gone: Vec<String> = work
                .rec
                .tensors
                .keys()
                .filter(|n| !work.touched.contains(*n))
                .cloned()
                .collect();
            for n in gone {
                Self::remove_from_slot(work, &n);
            }
        }
        let gone = check_version(
            m,
            work.bootstrap,
            work.rec.tensors.keys().cloned(),
            &work.touched,
            &work.rec.plain(),
        )?;
        for n in gone {
            Self::remove_from_slot(work, &n);
        }
        work.rec.version = Some(m.version);
        work.touched.clear();
        work.bootstrap = false;
        Ok(())
    }

    /// Keeps the journal versions some other slot still needs; removes the rest.
    fn prune_journal(&mut self) {
        let current = self.current.clone();
        Journal::of(&self.out).prune(&mut self.state, current.as_deref());
    }

    fn work(&mut self) -> Result<&mut Work> {
        self.work
            .as_mut()
            .ok_or_else(|| Error::BadRequest("no update in progress (call begin first)".into()))
    }
}

fn check_name(name: &str) -> Result<()> {
    if is_safe_file_name(name) {
        Ok(())
    } else {
        Err(Error::metadata(
            "manifest",
            format!("unsafe file name `{name}`"),
        ))
    }
}

impl Sink for DirSink {
    fn held(&self) -> Option<u64> {
        self.held
    }

    fn held_tensors(&self) -> Option<Vec<String>> {
        self.held?;
        let current = self.current.as_ref()?;
        Some(
            self.state.slots[current]
                .tensors
                .values()
                .flat_map(|f| f.tensors.keys().cloned())
                .collect(),
        )
    }

    fn begin(&mut self, base: Option<u64>) -> Result<()> {
        self.abort();
        if base.is_some() && base != self.held {
            return Err(Error::BadRequest(format!(
                "update from version {base:?}, the output holds {:?}",
                self.held
            )));
        }
        let slot = self.next_slot();
        let dir = self.slot_dir(&slot);
        let was = self.state.slots[&slot].clone();
        // Dirty before the first write, durably.
        self.state.slots.get_mut(&slot).expect("a slot").dirty = true;
        self.save_state()?;
        crate::failpoint::hit("subscriber.after_begin");
        if base.is_none() {
            // A bootstrap replaces everything: start from an empty slot.
            let _ = std::fs::remove_dir_all(&dir);
        }
        std::fs::create_dir_all(&dir).map_err(|e| io_err("creating", &dir, e))?;
        let mut work = Work {
            slot,
            dir,
            rec: if base.is_none() {
                SlotState::default()
            } else {
                was.clone()
            },
            bootstrap: base.is_none(),
            journal_reset: base.is_none(),
            ..Work::default()
        };
        let mapped = self.maps.remove(&work.slot).unwrap_or_default();
        if let Some(held) = base {
            self.bring_forward(&mut work, held, was.dirty, mapped)?;
        }
        work.produced.slot = Some(work.slot.clone());
        self.work = Some(work);
        Ok(())
    }

    fn anchor_dest(&mut self, name: &str) -> Result<AnchorDest> {
        check_name(name)?;
        let tmp = self.out.join(".tmp");
        std::fs::create_dir_all(&tmp).map_err(|e| io_err("creating", &tmp, e))?;
        let w = self.work()?;
        w.tmp_files += 1;
        Ok(AnchorDest::File(
            tmp.join(format!("{}-{}.download", w.slot, w.tmp_files)),
        ))
    }

    fn anchor(&mut self, name: &str, object: AnchorObject) -> Result<()> {
        check_name(name)?;
        let (path, layout) = match object {
            AnchorObject::Tensors(set) => return self.anchor_tensors(name, set),
            AnchorObject::File(p) => (p, None),
            AnchorObject::Expanded(p, layout) => (p, Some(layout)),
            AnchorObject::Bytes(b) => {
                let AnchorDest::File(p) = self.anchor_dest(name)? else {
                    unreachable!("a DirSink downloads into files")
                };
                std::fs::write(&p, &b).map_err(|e| io_err("writing", &p, e))?;
                (p, None)
            }
        };
        let work = self.work()?;
        work.open.remove(name);
        let object = match layout {
            Some(layout) => AnchorObject::Expanded(path.clone(), layout),
            None => AnchorObject::File(path.clone()),
        };
        let (_, set) = decode_anchor(name, object)?;
        let size = std::fs::metadata(&path)
            .map_err(|e| io_err("reading", &path, e))?
            .len();
        let data_start = size - set.total_bytes();
        let metadata = output_metadata(set.metadata());
        let header = padded_header(&set, &metadata, data_start as usize - 8)?.ok_or_else(|| {
            Error::metadata(
                "anchor",
                format!("`{name}`: the output header does not fit in the anchor's"),
            )
        })?;
        let mut head = (header.len() as u64).to_le_bytes().to_vec();
        head.extend_from_slice(&header);
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .and_then(|f| {
                std::os::unix::fs::FileExt::write_all_at(&f, &head, 0)?;
                f.sync_all()
            })
            .map_err(|e| io_err("writing the header of", &path, e))?;
        let dest = work.dir.join(name);
        if let Some(parent) = dest.parent() {
            std::fs::create_dir_all(parent).map_err(|e| io_err("creating", parent, e))?;
        }
        std::fs::rename(&path, &dest).map_err(|e| io_err("renaming", &path, e))?;
        work.rec.files.remove(name);
        work.rec.tensors.insert(
            name.to_string(),
            TensorFile::of(&set, size, blake3::hash(&head).to_hex().to_string()),
        );
        work.open.insert(name.to_string(), set);
        work.touched.insert(name.to_string());
        work.produced.written_bytes += size;
        crate::failpoint::hit("subscriber.after_anchor");
        Ok(())
    }

    fn delta(&mut self, version: u64, name: &str, delta: &[u8]) -> Result<ApplyReport> {
        check_name(name)?;
        self.journal().object(version, name, delta)?;
        let journal = self.journal();
        let report = Self::apply_to_slot(self.work()?, &journal, version, name, delta)?;
        crate::failpoint::hit("subscriber.mid_apply");
        Ok(report)
    }

    fn file(&mut self, version: u64, name: &str, body: &[u8]) -> Result<()> {
        check_name(name)?;
        self.journal().object(version, name, body)?;
        let work = self.work()?;
        if work.rec.tensors.contains_key(name) {
            Self::remove_from_slot(work, name);
        }
        Self::write_to_slot(work, name, body)
    }

    fn version_done(&mut self, m: &Manifest) -> Result<()> {
        self.journal().manifest(m)?;
        let work = self.work()?;
        Self::finish_version(work, m)?;
        work.journaled.push(m.version);
        Ok(())
    }

    fn commit(&mut self) -> Result<Produced> {
        self.finish(true)
    }

    /// Brings the slot the next update will write forward to the held
    /// version now (from the journal, or by a clone of the current slot), so
    /// that the next update applies only the new version's objects. Writes
    /// that slot: call it only once its files may change (after the hooks
    /// of the last switch ran).
    fn prepare(&mut self) -> Result<Produced> {
        let Some(held) = self.held else {
            return Ok(Produced::default());
        };
        let slot = self.next_slot();
        let rec = &self.state.slots[&slot];
        if !rec.dirty
            && rec.version == Some(held)
            && rec.trusted(&self.slot_dir(&slot), &DirState::record(&self.out))
        {
            return Ok(Produced::default());
        }
        self.begin(Some(held))?;
        self.finish(false)
    }

    fn abort(&mut self) {
        if let Some(work) = self.work.take() {
            drop(work);
            let _ = std::fs::remove_dir_all(self.out.join(".tmp"));
            // The slot stays marked dirty in the state: it is rebuilt before
            // it is used again.
        }
    }
}

impl DirSink {
    /// An anchor decoded already (a TRL bucket's): written into the work
    /// slot as a plain safetensors file (through `.tmp/`, then renamed), and
    /// mapped for the deltas after it.
    fn anchor_tensors(&mut self, name: &str, set: TensorSet) -> Result<()> {
        let AnchorDest::File(tmp) = self.anchor_dest(name)? else {
            unreachable!("a DirSink downloads into files")
        };
        let metadata = output_metadata(set.metadata());
        let file = std::fs::File::create(&tmp).map_err(|e| io_err("creating", &tmp, e))?;
        let mut w = std::io::BufWriter::with_capacity(8 << 20, file);
        set.write_to(&metadata, &mut w)?;
        let file = w
            .into_inner()
            .map_err(|e| io_err("writing", &tmp, e.into_error()))?;
        file.sync_all().map_err(|e| io_err("syncing", &tmp, e))?;
        drop(file);
        let digests: Vec<Digest> = set.tensors().iter().map(|t| t.digest).collect();
        drop(set);
        let mut mapped = TensorSet::map(&tmp, true, Digests::Skip)?;
        mapped.assume_digests(&digests)?;
        let size = std::fs::metadata(&tmp)
            .map_err(|e| io_err("reading", &tmp, e))?
            .len();
        let head_len = (size - mapped.total_bytes()) as usize;
        let head = std::fs::read(&tmp)
            .map_err(|e| io_err("reading", &tmp, e))?
            .get(..head_len)
            .map(|h| blake3::hash(h).to_hex().to_string())
            .unwrap_or_default();
        let work = self.work()?;
        work.open.remove(name);
        let dest = work.dir.join(name);
        if let Some(parent) = dest.parent() {
            std::fs::create_dir_all(parent).map_err(|e| io_err("creating", parent, e))?;
        }
        std::fs::rename(&tmp, &dest).map_err(|e| io_err("renaming", &tmp, e))?;
        work.rec.files.remove(name);
        work.rec
            .tensors
            .insert(name.to_string(), TensorFile::of(&mapped, size, head));
        work.open.insert(name.to_string(), mapped);
        work.touched.insert(name.to_string());
        work.produced.written_bytes += size;
        crate::failpoint::hit("subscriber.after_anchor");
        Ok(())
    }

    /// Ends the update: flushes the work slot, records it clean at its
    /// version and, with `switch`, points `current` at it.
    fn finish(&mut self, switch: bool) -> Result<Produced> {
        let mut work = self
            .work
            .take()
            .ok_or_else(|| Error::BadRequest("no update in progress".into()))?;
        let result = (|| {
            // Data first: mapped files (msync), then written and cloned files,
            // then the directories that name them.
            let started = std::time::Instant::now();
            for (name, set) in &work.open {
                set.flush()?;
                if let Some(rec) = work.rec.tensors.get_mut(name) {
                    for t in set.tensors() {
                        if let Some(s) = rec.tensors.get_mut(&t.name) {
                            s.digest = t.digest.to_string();
                        }
                    }
                }
            }
            for p in std::mem::take(&mut work.to_sync) {
                if p.exists() {
                    sync_file(&p)?;
                }
            }
            for d in list_dirs(&work.dir).map_err(|e| io_err("listing", &work.dir, e))? {
                sync_dir(&d)?;
            }
            tracing::debug!(
                slot = %work.slot,
                seconds = started.elapsed().as_secs_f64(),
                "slot flushed"
            );
            if work.rec.version.is_none() {
                return Err(Error::BadRequest(
                    "update committed without a version".into(),
                ));
            }
            // Then the record (the slot is clean at its version)...
            work.rec.restamp(&work.dir)?;
            work.rec.dirty = false;
            self.state.slots.insert(work.slot.clone(), work.rec.clone());
            if work.journal_reset {
                self.state.journal.clear();
            }
            self.state.journal.extend(&work.journaled);
            self.state.journal.sort_unstable();
            self.state.journal.dedup();
            self.save_state()?;
            crate::failpoint::hit("subscriber.before_switch");
            // ...then the switch.
            if switch {
                self.switch(&work.slot)?;
                crate::failpoint::hit("subscriber.after_switch");
                self.held = work.rec.version;
                self.damaged = false;
            }
            Ok(())
        })();
        if let Err(e) = result {
            // The slot stays dirty in the state: rebuilt next time.
            self.work = Some(work);
            self.abort();
            return Err(e);
        }
        let mapped = std::mem::take(&mut work.open);
        self.maps.insert(work.slot.clone(), mapped);
        self.prune_journal();
        if let Err(e) = self.save_state() {
            tracing::warn!(error = %e, "could not record the pruned journal");
        }
        // Leftovers: downloads, and the directory layout of older releases.
        let _ = std::fs::remove_dir_all(self.out.join(".tmp"));
        // (`versions/<v>`; a TRL follower's `trl/step_N` and its state.)
        for legacy in ["versions", "trl"] {
            let legacy = self.out.join(legacy);
            if legacy.is_dir() {
                let _ = std::fs::remove_dir_all(&legacy);
            }
        }
        let _ = std::fs::remove_file(self.out.join(".trl-state.json"));
        Ok(work.produced)
    }
}
