//! Sinks: where verified versions go.
//!
//! A [`Sink`] receives one update at a time, as calls in this order:
//!
//! ```text
//! begin(base)                      base = Some(held) to replay onto what it holds, None to bootstrap
//! ( anchor_dest(name), anchor(name, object) | delta(v, name, bytes) | file(v, name, bytes) )*
//! version_done(manifest)           after each version's objects: the sink is now at that version
//! ...                              (more versions)
//! commit()  |  abort()             make the result visible, or drop it
//! prepare()                        optional, between updates: idle work that makes the next one cheaper
//! ```
//!
//! Every object handed to a sink has already been checked against its
//! manifest entry (size, BLAKE3) by the fetcher; the sink checks every delta
//! against its base (digests, through [`crate::codec::apply_delta`]) and
//! every anchor against its own header ([`decode_anchor`], the codec's one
//! anchor decoder).
//!
//! Two sinks: [`DirSink`](super::dir::DirSink) (an output directory with A/B
//! slots, patched in place, switched atomically) and [`MemorySink`]
//! (in-memory tensors, patched in place). A sink over buffers a caller owns —
//! an engine's or Python's tensors — is a [`MemorySink`] started from sets
//! built with [`TensorSet::from_external`] ([`MemorySink::with_state`]): deltas
//! are applied in the caller's memory, and an anchor of the same structure is
//! copied into it rather than replacing it.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

use serde::Serialize;

use crate::codec::{ApplyReport, apply_delta, inspect};
use crate::digest::Digest;
use crate::dtype::word_bytes;
use crate::error::{Error, Result};
use crate::protocol::{Manifest, ObjectRole};
use crate::tensors::TensorSet;

/// The one anchor decoder (`codec::anchor`): an anchor object in memory or
/// in a file ([`AnchorObject`]), raw or compressed, decoded into a tensor
/// set verified against the anchor's header ([`decode_anchor`]); a
/// compressed file is expanded in place ([`expand_planes`]).
pub use crate::codec::anchor::{AnchorObject, decode_anchor, expand_planes};

/// Where a sink wants an anchor object downloaded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AnchorDest {
    /// Into memory.
    Memory,
    /// Into this file (created or truncated by the fetcher).
    File(PathBuf),
}

/// What producing a version cost the sink.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Produced {
    /// Bytes the sink wrote: anchors, non-tensor files, changed elements
    /// patched in place (changed words × word width), rewritten headers,
    /// copies made to rebuild a slot.
    pub written_bytes: u64,
    /// Bytes of journal objects (verified deltas and files kept from earlier
    /// updates) applied to bring an output slot forward to the held version.
    pub journal_bytes: u64,
    /// Bytes copied from the current slot to rebuild another (0 where the
    /// filesystem shares extents: reflinks).
    pub cloned_bytes: u64,
    /// The output slot now current, for sinks that have slots.
    pub slot: Option<String>,
}

/// Where verified versions go (see the module documentation for the call order).
pub trait Sink {
    /// The verified version the sink holds and can replay onto (`None`:
    /// nothing, or nothing trustworthy — the next update must bootstrap).
    fn held(&self) -> Option<u64>;
    /// The names of the tensors the sink holds, where it knows them (an
    /// anchor that replaces them must hold each, for TRL buckets).
    fn held_tensors(&self) -> Option<Vec<String>> {
        None
    }
    /// The most versions one update may carry (`None`: any number). A sink
    /// that verifies a version against the bytes it holds before it writes
    /// anything (tensors a caller owns) can stage only one version at a
    /// time; an anchor and the versions after it are always one update.
    fn max_versions(&self) -> Option<usize> {
        None
    }
    /// Starts an update: onto the held version (`Some(held)`), or from
    /// scratch (`None`, the first objects are a version's anchors).
    fn begin(&mut self, base: Option<u64>) -> Result<()>;
    /// Where the anchor object for tensor file `name` should be downloaded.
    fn anchor_dest(&mut self, name: &str) -> Result<AnchorDest>;
    /// The anchor object for tensor file `name` (verified against its
    /// manifest entry, not yet against its own header).
    fn anchor(&mut self, name: &str, object: AnchorObject) -> Result<()>;
    /// Applies the delta object of version `version` for tensor file `name`.
    fn delta(&mut self, version: u64, name: &str, delta: &[u8]) -> Result<ApplyReport>;
    /// The non-tensor file `name` as of version `version`.
    fn file(&mut self, version: u64, name: &str, body: &[u8]) -> Result<()>;
    /// Every object of `m` was given: the sink is now at `m.version`. Files
    /// the version does not list are removed.
    fn version_done(&mut self, m: &Manifest) -> Result<()>;
    /// Makes the update visible (durably, for sinks with storage).
    fn commit(&mut self) -> Result<Produced>;
    /// Drops the update; what was visible stays as it was.
    fn abort(&mut self);
    /// Idle work between updates that makes the next one cheaper (a
    /// [`DirSink`](super::dir::DirSink) brings the slot the next update will
    /// write forward to the held version). Nothing visible changes. The
    /// default does nothing.
    fn prepare(&mut self) -> Result<Produced> {
        Ok(Produced::default())
    }
}

/// The `__metadata__` of an output file: the anchor's, without the
/// `weightcast.*` keys (`format=pt` and whatever the trainer wrote stay).
pub fn output_metadata(anchor: &BTreeMap<String, String>) -> BTreeMap<String, String> {
    anchor
        .iter()
        .filter(|(k, _)| !k.starts_with("weightcast."))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

/// Applies a delta object of `version` for file `name` to `set` (all or
/// nothing); the loop checks the report against what the bucket promised
/// (a weightcast bucket's deltas verify, to exactly that version).
pub(crate) fn apply_checked(
    set: &mut TensorSet,
    _version: u64,
    _name: &str,
    delta: &[u8],
) -> Result<ApplyReport> {
    apply_delta(set, delta)
}

/// Bytes an apply of `delta` wrote into `set`: changed words × word width,
/// from the delta's header.
pub(crate) fn patched_bytes(set: &TensorSet, delta: &[u8]) -> u64 {
    let Ok((_, Some(h))) = inspect(delta) else {
        return 0;
    };
    h.tensors
        .iter()
        .filter_map(|(n, e)| {
            let t = &set.tensors()[set.position(n)?];
            Some(e.changed * word_bytes(t.dtype) as u64)
        })
        .sum()
}

/// Checks a finished version's files against its manifest: a replayed
/// version moved every tensor file the sink holds (`touched`), and every
/// non-tensor file the manifest lists as unchanged is held with its size and
/// BLAKE3 (`have`). Returns the non-tensor files held that the version no
/// longer lists (to delete).
pub(crate) fn check_version(
    m: &Manifest,
    bootstrap: bool,
    tensors: impl IntoIterator<Item = String>,
    touched: &BTreeSet<String>,
    have: &BTreeMap<String, (u64, String)>,
) -> Result<Vec<String>> {
    if !bootstrap && let Some(stale) = tensors.into_iter().find(|n| !touched.contains(n)) {
        return Err(Error::metadata(
            "manifest",
            format!("version {} has no delta for `{stale}`", m.version),
        ));
    }
    for f in &m.files {
        if have.get(&f.name) != Some(&(f.size, f.blake3.clone())) {
            return Err(Error::metadata(
                "manifest",
                format!(
                    "version {} lists `{}` ({} bytes, BLAKE3 {}), which the base does not hold",
                    m.version, f.name, f.size, f.blake3
                ),
            ));
        }
    }
    let listed: BTreeSet<&str> = m.files.iter().map(|f| f.name.as_str()).collect();
    Ok(have
        .keys()
        .filter(|n| !listed.contains(n.as_str()))
        .cloned()
        .collect())
}

/// In-memory tensors and files, patched in place.
#[derive(Debug, Default)]
pub struct MemorySink {
    version: Option<u64>,
    tensors: BTreeMap<String, TensorSet>,
    files: BTreeMap<String, Vec<u8>>,
    touched: BTreeSet<String>,
    bootstrap: bool,
    working: bool,
    written: u64,
}

impl MemorySink {
    /// An empty sink (the first update bootstraps).
    pub fn new() -> MemorySink {
        MemorySink::default()
    }

    /// A sink over existing tensor sets (e.g. the caller's buffers, built
    /// with [`TensorSet::from_external`]) and non-tensor files. With
    /// `Some(version)` they hold that version and each set must have valid
    /// digests (computed, or assumed from a trusted record with
    /// [`TensorSet::assume_digests`]); with `None` the first update
    /// bootstraps, copying each anchor into the set of the same name and
    /// structure instead of replacing it.
    pub fn with_state(
        version: Option<u64>,
        tensors: BTreeMap<String, TensorSet>,
        files: BTreeMap<String, Vec<u8>>,
    ) -> Result<MemorySink> {
        if version.is_some()
            && let Some((n, _)) = tensors.iter().find(|(_, s)| !s.has_digests())
        {
            return Err(Error::BadRequest(format!(
                "tensor file `{n}` has no digests: compute or assume them first"
            )));
        }
        Ok(MemorySink {
            version,
            tensors,
            files,
            ..MemorySink::default()
        })
    }

    /// The tensor files (valid when [`Sink::held`] is `Some`).
    pub fn tensors(&self) -> &BTreeMap<String, TensorSet> {
        &self.tensors
    }

    /// The non-tensor files.
    pub fn files(&self) -> &BTreeMap<String, Vec<u8>> {
        &self.files
    }

    /// The held version, the tensor files and the non-tensor files, taken
    /// out of the sink (a caller that moves a bootstrapped version elsewhere:
    /// the Python binding's anchor updates).
    pub fn into_parts(self) -> MemoryParts {
        (self.version, self.tensors, self.files)
    }
}

/// What [`MemorySink::into_parts`] returns: the held version, the tensor
/// files and the non-tensor files.
pub type MemoryParts = (
    Option<u64>,
    BTreeMap<String, TensorSet>,
    BTreeMap<String, Vec<u8>>,
);

impl Sink for MemorySink {
    fn held(&self) -> Option<u64> {
        self.version
    }

    fn held_tensors(&self) -> Option<Vec<String>> {
        self.version?;
        Some(
            self.tensors
                .values()
                .flat_map(|s| s.tensors().iter().map(|t| t.name.clone()))
                .collect(),
        )
    }

    fn begin(&mut self, base: Option<u64>) -> Result<()> {
        if base.is_some() && base != self.version {
            return Err(Error::BadRequest(format!(
                "update from version {base:?}, the sink holds {:?}",
                self.version
            )));
        }
        self.working = true;
        self.bootstrap = base.is_none();
        self.touched.clear();
        self.written = 0;
        Ok(())
    }

    fn anchor_dest(&mut self, _name: &str) -> Result<AnchorDest> {
        Ok(AnchorDest::Memory)
    }

    fn anchor(&mut self, name: &str, object: AnchorObject) -> Result<()> {
        let mut set = match object {
            AnchorObject::Tensors(set) => set,
            object => decode_anchor(name, object)?.1,
        };
        set.set_metadata(output_metadata(set.metadata()));
        self.written += set.total_bytes();
        self.touched.insert(name.to_string());
        match self.tensors.get_mut(name) {
            // Memory someone else owns (caller buffers) with the same
            // tensors: copied into, not replaced.
            Some(held) if held.is_shared() && held.same_structure(&set).is_ok() => {
                for i in 0..set.len() {
                    held.data_mut(i).copy_from_slice(set.data(i));
                }
                let digests: Vec<Digest> = set.tensors().iter().map(|t| t.digest).collect();
                held.assume_digests(&digests)
            }
            _ => {
                self.tensors.insert(name.to_string(), set);
                Ok(())
            }
        }
    }

    fn delta(&mut self, version: u64, name: &str, delta: &[u8]) -> Result<ApplyReport> {
        let set = self.tensors.get_mut(name).ok_or_else(|| {
            Error::metadata(
                "manifest",
                format!("delta for `{name}`, which the base does not have"),
            )
        })?;
        let report = apply_checked(set, version, name, delta)?;
        self.written += patched_bytes(set, delta);
        self.touched.insert(name.to_string());
        Ok(report)
    }

    fn file(&mut self, _version: u64, name: &str, body: &[u8]) -> Result<()> {
        self.written += body.len() as u64;
        self.files.insert(name.to_string(), body.to_vec());
        Ok(())
    }

    fn version_done(&mut self, m: &Manifest) -> Result<()> {
        let anchors = m.objects.iter().any(|o| o.role == ObjectRole::Anchor);
        let bootstrap = self.bootstrap && anchors;
        if bootstrap {
            let touched = &self.touched;
            self.tensors.retain(|n, _| touched.contains(n));
        }
        let have = self
            .files
            .iter()
            .map(|(n, b)| {
                let h = blake3::hash(b).to_hex().to_string();
                (n.clone(), (b.len() as u64, h))
            })
            .collect();
        let gone = check_version(
            m,
            bootstrap,
            self.tensors.keys().cloned(),
            &self.touched,
            &have,
        )?;
        for n in gone {
            self.files.remove(&n);
        }
        self.version = Some(m.version);
        self.bootstrap = false;
        self.touched.clear();
        Ok(())
    }

    fn commit(&mut self) -> Result<Produced> {
        self.working = false;
        Ok(Produced {
            written_bytes: std::mem::take(&mut self.written),
            ..Produced::default()
        })
    }

    fn abort(&mut self) {
        // Patched in place: a half-applied update leaves nothing to trust.
        if self.working {
            self.version = None;
            self.working = false;
        }
    }
}
