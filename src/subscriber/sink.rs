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

use crate::codec::{ApplyReport, Context, apply_delta_ctx, inspect};
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

/// Applies a delta object to `set` (all or nothing) against `context`, the
/// file's `compact2` context (docs/format.md §6.3: the changes of the delta
/// that produced the set's version); the loop checks the report against
/// what the bucket promised (a weightcast bucket's deltas verify, to
/// exactly that version). Returns also the file's context for the next
/// delta (`None` unless the delta is `compact2`).
pub(crate) fn apply_checked(
    set: &mut TensorSet,
    delta: &[u8],
    context: Option<&Context>,
) -> Result<(ApplyReport, Option<Context>)> {
    apply_delta_ctx(set, delta, context)
}

/// Per tensor file, the `compact2` context of the version a sink holds (the
/// changes of the delta that produced it; none after an anchor). Every
/// version has a delta object for every tensor file, so each file's entry
/// is always the one its next delta was made against.
#[derive(Debug, Default, Clone)]
pub(crate) struct Contexts(BTreeMap<String, Context>);

impl Contexts {
    /// File `name`'s context.
    pub(crate) fn get(&self, name: &str) -> Option<&Context> {
        self.0.get(name)
    }

    /// Sets (or, with `None`, drops) file `name`'s context.
    pub(crate) fn set(&mut self, name: &str, c: Option<Context>) {
        match c {
            Some(c) => self.0.insert(name.to_string(), c),
            None => self.0.remove(name),
        };
    }

    /// Applies a delta object for file `name` to `set` with the file's
    /// context, and keeps the one it makes ([`apply_checked`]).
    pub(crate) fn apply(
        &mut self,
        set: &mut TensorSet,
        name: &str,
        delta: &[u8],
    ) -> Result<ApplyReport> {
        let (report, next) = apply_checked(set, delta, self.get(name))?;
        self.set(name, next);
        Ok(report)
    }

    /// Forgets every context (an anchor, or a state no longer trusted).
    pub(crate) fn clear(&mut self) {
        self.0.clear();
    }
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

/// In-memory tensors and files: deltas patched in place, an anchor
/// assembled apart and swapped in at the commit.
///
/// A replay patches the held tensors in place (memory in proportion to the
/// changes); each version the update finishes is held from then on, so a
/// replay that fails at a later version keeps the last one it finished, and
/// only a version left half-applied (one of its files patched, another
/// refused) leaves nothing held. A bootstrap decodes its anchors and the
/// versions after them into new sets while the old ones stay held, and the
/// commit swaps them in — or, for memory the caller owns with the same
/// structure, copies them in — so a failed bootstrap changes nothing.
#[derive(Debug, Default)]
pub struct MemorySink {
    version: Option<u64>,
    tensors: BTreeMap<String, TensorSet>,
    files: BTreeMap<String, Vec<u8>>,
    contexts: Contexts,
    work: Option<MemoryWork>,
}

/// Tensor files and non-tensor files, by name.
type Files = (BTreeMap<String, TensorSet>, BTreeMap<String, Vec<u8>>);

/// The update in progress.
#[derive(Debug, Default)]
struct MemoryWork {
    /// A bootstrap's tensors and files, assembled apart.
    fresh: Option<Files>,
    /// The version the update has reached.
    version: Option<u64>,
    /// The held tensors were patched since the last finished version.
    dirty: bool,
    touched: BTreeSet<String>,
    /// The next version starts from an anchor (its objects are anchors).
    bootstrap: bool,
    written: u64,
    /// A bootstrap's contexts.
    contexts: Contexts,
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
            contexts: Contexts::default(),
            work: None,
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

    /// Per tensor file, the `compact2` context of the held version.
    pub(crate) fn contexts(&self) -> &Contexts {
        &self.contexts
    }

    /// The held version, the tensor files and the non-tensor files, taken
    /// out of the sink (a caller that moves a bootstrapped version elsewhere).
    pub fn into_parts(self) -> MemoryParts {
        (self.version, self.tensors, self.files)
    }

    fn work(&mut self) -> Result<&mut MemoryWork> {
        self.work
            .as_mut()
            .ok_or_else(|| Error::BadRequest("no update in progress (call begin first)".into()))
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
        self.abort();
        if base.is_some() && base != self.version {
            return Err(Error::BadRequest(format!(
                "update from version {base:?}, the sink holds {:?}",
                self.version
            )));
        }
        self.work = Some(MemoryWork {
            fresh: base.is_none().then(Default::default),
            version: base,
            bootstrap: base.is_none(),
            ..MemoryWork::default()
        });
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
        let w = self.work()?;
        let Some((fresh, _)) = w.fresh.as_mut() else {
            return Err(Error::BadRequest(
                "an anchor object outside a bootstrap".into(),
            ));
        };
        w.written += set.total_bytes();
        w.touched.insert(name.to_string());
        fresh.insert(name.to_string(), set);
        Ok(())
    }

    fn delta(&mut self, _version: u64, name: &str, delta: &[u8]) -> Result<ApplyReport> {
        let w = self
            .work
            .as_mut()
            .ok_or_else(|| Error::BadRequest("no update in progress (call begin first)".into()))?;
        let (set, contexts) = match w.fresh.as_mut() {
            Some((fresh, _)) => (fresh.get_mut(name), &mut w.contexts),
            None => (self.tensors.get_mut(name), &mut self.contexts),
        };
        let set = set.ok_or_else(|| {
            Error::metadata(
                "manifest",
                format!("delta for `{name}`, which the base does not have"),
            )
        })?;
        let report = contexts.apply(set, name, delta)?;
        w.written += patched_bytes(set, delta);
        w.dirty |= w.fresh.is_none();
        w.touched.insert(name.to_string());
        Ok(report)
    }

    fn file(&mut self, _version: u64, name: &str, body: &[u8]) -> Result<()> {
        let w = self
            .work
            .as_mut()
            .ok_or_else(|| Error::BadRequest("no update in progress (call begin first)".into()))?;
        w.written += body.len() as u64;
        match w.fresh.as_mut() {
            Some((_, files)) => files.insert(name.to_string(), body.to_vec()),
            None => {
                w.dirty = true;
                self.files.insert(name.to_string(), body.to_vec())
            }
        };
        Ok(())
    }

    fn version_done(&mut self, m: &Manifest) -> Result<()> {
        let w = self
            .work
            .as_mut()
            .ok_or_else(|| Error::BadRequest("no update in progress (call begin first)".into()))?;
        let anchors = m.objects.iter().any(|o| o.role == ObjectRole::Anchor);
        let bootstrap = w.bootstrap && anchors;
        let in_place = w.fresh.is_none();
        let (tensors, files) = match w.fresh.as_mut() {
            Some((t, f)) => (t, f),
            None => (&mut self.tensors, &mut self.files),
        };
        if bootstrap {
            let touched = &w.touched;
            tensors.retain(|n, _| touched.contains(n));
        }
        let have = files
            .iter()
            .map(|(n, b)| {
                let h = blake3::hash(b).to_hex().to_string();
                (n.clone(), (b.len() as u64, h))
            })
            .collect();
        let gone = check_version(m, bootstrap, tensors.keys().cloned(), &w.touched, &have)?;
        for n in gone {
            files.remove(&n);
            w.dirty |= in_place;
        }
        w.version = Some(m.version);
        w.bootstrap = false;
        w.touched.clear();
        if in_place {
            // Patched in place: the sink holds this version from now on.
            self.version = Some(m.version);
            w.dirty = false;
        }
        Ok(())
    }

    fn commit(&mut self) -> Result<Produced> {
        let w = self
            .work
            .take()
            .ok_or_else(|| Error::BadRequest("no update in progress".into()))?;
        if let Some((fresh, files)) = w.fresh {
            let version = w.version.ok_or_else(|| {
                Error::BadRequest("a bootstrap committed without a version".into())
            })?;
            let names: BTreeSet<String> = fresh.keys().cloned().collect();
            self.tensors.retain(|n, _| names.contains(n));
            for (name, set) in fresh {
                match self.tensors.get_mut(&name) {
                    // Memory someone else owns (caller buffers) with the same
                    // tensors: copied into, not replaced.
                    Some(held) if held.is_shared() && held.same_structure(&set).is_ok() => {
                        for i in 0..set.len() {
                            held.data_mut(i).copy_from_slice(set.data(i));
                        }
                        let digests: Vec<Digest> = set.tensors().iter().map(|t| t.digest).collect();
                        held.assume_digests(&digests)?;
                    }
                    _ => {
                        self.tensors.insert(name, set);
                    }
                }
            }
            self.files = files;
            self.contexts = w.contexts;
            self.version = Some(version);
        }
        Ok(Produced {
            written_bytes: w.written,
            ..Produced::default()
        })
    }

    fn abort(&mut self) {
        // A version left half-applied in place leaves nothing to trust; a
        // finished one stays held; a bootstrap assembled apart is dropped.
        if let Some(w) = self.work.take()
            && w.dirty
        {
            self.version = None;
            self.contexts.clear();
        }
    }
}
