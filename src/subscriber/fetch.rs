//! The fetcher: the subscriber's only reader of the store. Manifests and
//! listings go through it so that every request is counted; objects come
//! back only after their size and BLAKE3 matched the manifest entry.
//!
//! Small objects (deltas, non-tensor files) are read into memory, bounded by
//! the size the manifest gives. Large objects (anchors, from
//! [`LARGE_OBJECT`] bytes) are downloaded as concurrent ranged GETs of
//! [`PART_SIZE`] bytes, [`PARTS_IN_FLIGHT`] at a time, each streamed straight
//! into its place in a file (or a buffer): memory is a few network chunks
//! per part in flight, whatever the object's size. The file's BLAKE3 is then
//! computed over a memory map on every core. A `planes` anchor is decoded
//! while it downloads ([`Fetcher::anchor_to_file`]), following the parts
//! that are in.
//!
//! A size declared in a manifest is trusted for nothing: an object declared
//! larger than [`Fetcher::max_object_size`] is refused before any request;
//! the store's own size for it must match the declared one at its first
//! answer; and buffers and files grow with the bytes actually received,
//! never from the declared size.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;

use crate::error::{Error, Result};
use crate::protocol::{Latest, Manifest, ObjectEntry, read_latest, read_manifest, versions_after};
use crate::store::Store;

/// Objects at least this large are downloaded in ranged parts.
pub const LARGE_OBJECT: u64 = 64 << 20;
/// Bytes per ranged GET.
pub const PART_SIZE: u64 = 16 << 20;
/// Ranged GETs in flight per object.
pub const PARTS_IN_FLIGHT: usize = 8;

/// Reads the store for a subscriber, counting requests.
#[derive(Clone, Debug)]
pub struct Fetcher {
    store: Store,
    requests: Arc<AtomicU64>,
    /// Objects at least this large are downloaded in ranged parts ([`LARGE_OBJECT`]).
    pub large_object: u64,
    /// Bytes per ranged GET ([`PART_SIZE`]).
    pub part_size: u64,
    /// Ranged GETs in flight ([`PARTS_IN_FLIGHT`]).
    pub parts_in_flight: usize,
    /// The largest object read, in memory or into a file (the store's
    /// [`Store::max_object_size`] by default; `--max-object-size`).
    pub max_object_size: u64,
}

impl Fetcher {
    /// A fetcher of `store` with the default part sizes.
    pub fn new(store: Store) -> Fetcher {
        Fetcher {
            max_object_size: store.max_object_size(),
            store,
            requests: Arc::new(AtomicU64::new(0)),
            large_object: LARGE_OBJECT,
            part_size: PART_SIZE,
            parts_in_flight: PARTS_IN_FLIGHT,
        }
    }

    /// The store.
    pub fn store(&self) -> &Store {
        &self.store
    }

    /// Store requests made so far (by this fetcher and its clones).
    pub fn requests(&self) -> u64 {
        self.requests.load(Ordering::Relaxed)
    }

    /// Counts `n` requests made through [`Fetcher::store`] directly.
    pub fn count(&self, n: u64) {
        self.requests.fetch_add(n, Ordering::Relaxed);
    }

    /// Committed versions after `after` (all when `None`): one listing.
    pub async fn versions_after(&self, after: Option<u64>) -> Result<Vec<u64>> {
        self.count(1);
        versions_after(&self.store, after).await
    }

    /// The manifest of `version`, validated; `None` if not committed.
    pub async fn manifest(&self, version: u64) -> Result<Option<Manifest>> {
        self.count(1);
        read_manifest(&self.store, version).await
    }

    /// The `latest.json` hint unless it still has ETag `known` (see
    /// [`read_latest`]).
    pub async fn latest(&self, known: Option<&str>) -> Result<Option<(Latest, Option<String>)>> {
        self.count(1);
        read_latest(&self.store, known).await
    }

    /// Refuses an object declared larger than [`Fetcher::max_object_size`].
    fn within_limit(&self, o: &ObjectEntry) -> Result<()> {
        if o.size > self.max_object_size {
            return Err(Error::TooLarge {
                key: o.key.clone(),
                size: o.size,
                max: self.max_object_size,
            });
        }
        Ok(())
    }

    /// Downloads an object into memory and checks it against its entry.
    /// Large objects come down in ranged parts into a buffer that grows with
    /// the bytes received (refused cleanly if that memory cannot be had).
    pub async fn bytes(&self, o: &ObjectEntry) -> Result<Bytes> {
        self.within_limit(o)?;
        let body = if o.size < self.large_object {
            self.count(1);
            let progress = self.store.download_progress();
            if let Some(p) = progress {
                p.started(&o.key, o.size);
            }
            // The manifest's size bounds the read: an object that grew is
            // refused from its reported size, before its body is buffered.
            let body = self
                .store
                .get_at_most(&o.key, o.size)
                .await?
                .ok_or_else(|| self.missing(o))?;
            if let Some(p) = progress {
                p.advanced(body.len() as u64);
            }
            body
        } else {
            // Never sized from the manifest: the store's size is checked at
            // its first answer, and the buffer grows only to the end of the
            // bytes received so far (parts arrive in any order).
            let buf = std::sync::Mutex::new(Vec::<u8>::new());
            let n = self
                .store
                .download_ranges(
                    &o.key,
                    o.size,
                    self.part_size,
                    self.parts_in_flight,
                    |at, b| {
                        let mut buf = buf.lock().expect("not poisoned");
                        let (at, end) = (at as usize, at as usize + b.len());
                        let have = buf.len();
                        if have < end {
                            buf.try_reserve(end - have).map_err(|_| {
                                Error::io(
                                    format!("buffering object {} ({} bytes)", o.key, o.size),
                                    std::io::Error::from(std::io::ErrorKind::OutOfMemory),
                                )
                            })?;
                            buf.resize(end, 0);
                        }
                        buf[at..end].copy_from_slice(b);
                        Ok(())
                    },
                    |_| {},
                )
                .await?;
            self.count(n);
            Bytes::from(buf.into_inner().expect("not poisoned"))
        };
        self.check(o, body.len() as u64, crate::digest::blake3_of(&body))?;
        Ok(body)
    }

    /// Downloads an object into the file at `path` (created or truncated)
    /// and checks it against its entry; on a mismatch the file is removed.
    /// The file is not synced: the caller decides when it must be durable.
    pub async fn to_file(&self, o: &ObjectEntry, path: &Path) -> Result<()> {
        use std::os::unix::fs::FileExt;
        self.within_limit(o)?;
        if o.size < self.large_object {
            let body = self.bytes(o).await?;
            let io = |e| Error::io(format!("writing {}", path.display()), e);
            let file = std::fs::File::create(path).map_err(io)?;
            file.write_all_at(&body, 0).map_err(io)?;
            return Ok(());
        }
        self.download_checked(o, path, |_| {}).await
    }

    /// Downloads large object `o` into the file at `path` (created or
    /// truncated) in ranged parts, calling `done(range)` as each part is in,
    /// and checks it against its entry; on any failure the file is removed.
    async fn download_checked(
        &self,
        o: &ObjectEntry,
        path: &Path,
        done: impl Fn(std::ops::Range<u64>),
    ) -> Result<()> {
        let io = |e| Error::io(format!("writing {}", path.display()), e);
        let r = async {
            let file = std::fs::File::create(path).map_err(io)?;
            // The file grows with the parts written (never set to the
            // declared size: a manifest cannot make this take disk the store
            // does not hold).
            let n = self
                .store
                .download_to(
                    &o.key,
                    o.size,
                    &file,
                    self.part_size,
                    self.parts_in_flight,
                    done,
                )
                .await?;
            self.count(n);
            let len = file.metadata().map_err(io)?.len();
            let mut h = blake3::Hasher::new();
            h.update_mmap_rayon(path)
                .map_err(|e| Error::io(format!("hashing {}", path.display()), e))?;
            self.check(o, len, h.finalize())
        }
        .await;
        if r.is_err() {
            let _ = std::fs::remove_file(path);
        }
        r
    }

    /// [`Fetcher::to_file`] for an anchor object: a `planes` anchor that
    /// comes in ranged parts is decoded while it downloads
    /// ([`expand_following`](crate::codec::expand_following)), so that little of its decode is left after
    /// its last byte. `Some(layout)`: `path` holds the raw anchor (every
    /// chunk and digest checked against `layout`, the object's size and
    /// BLAKE3 matched). `None`: `path` holds the object as downloaded, for
    /// the sink to decode (a raw anchor, a small object, or one the decode
    /// refused: the sink's decode reports why).
    pub async fn anchor_to_file(
        &self,
        o: &ObjectEntry,
        path: &Path,
    ) -> Result<Option<crate::codec::planes::PlanesLayout>> {
        if o.size < self.large_object {
            self.to_file(o, path).await?;
            return Ok(None);
        }
        self.within_limit(o)?;
        let (tx, rx) = std::sync::mpsc::channel();
        let follower = tokio::task::spawn_blocking({
            let (p, size) = (path.to_path_buf(), o.size);
            move || crate::codec::expand_following(&p, size, rx)
        });
        let raw = path.with_extension("raw");
        let contiguous = std::sync::Mutex::new(Contiguous::new(o.size, self.part_size));
        let checked = self
            .download_checked(o, path, |range| {
                let upto = contiguous.lock().expect("not poisoned").done(range);
                // A follower that stopped (not a `planes` object) hangs up.
                let _ = tx.send(upto);
            })
            .await;
        drop(tx);
        let expanded = follower.await;
        if let Err(e) = checked {
            let _ = std::fs::remove_file(&raw);
            return Err(e);
        }
        match expanded {
            Ok(Ok(Some(layout))) => {
                std::fs::rename(&raw, path)
                    .map_err(|e| Error::io(format!("renaming {}", raw.display()), e))?;
                Ok(Some(layout))
            }
            _ => {
                let _ = std::fs::remove_file(&raw);
                Ok(None)
            }
        }
    }

    fn missing(&self, o: &ObjectEntry) -> Error {
        Error::NotFound(format!(
            "object `{}` is missing from `{}`",
            o.key,
            self.store.url()
        ))
    }

    fn check(&self, o: &ObjectEntry, len: u64, hash: blake3::Hash) -> Result<()> {
        if len != o.size || hash.to_hex().as_str() != o.blake3 {
            return Err(Error::Integrity {
                scope: format!("object {} at `{}`", o.key, self.store.url()),
                expected: format!("{} bytes, BLAKE3 {}", o.size, o.blake3),
                actual: format!("{len} bytes, BLAKE3 {}", hash.to_hex()),
            });
        }
        Ok(())
    }
}

/// How many of an object's first bytes are in, from the parts that are.
struct Contiguous {
    part: u64,
    size: u64,
    done: Vec<bool>,
    next: usize,
}

impl Contiguous {
    fn new(size: u64, part: u64) -> Contiguous {
        let part = part.max(1);
        Contiguous {
            part,
            size,
            done: vec![false; size.div_ceil(part) as usize],
            next: 0,
        }
    }

    /// Part `range` is in; returns how many of the first bytes are.
    fn done(&mut self, range: std::ops::Range<u64>) -> u64 {
        if let Some(d) = self.done.get_mut((range.start / self.part) as usize) {
            *d = true;
        }
        while self.done.get(self.next).copied().unwrap_or(false) {
            self.next += 1;
        }
        (self.next as u64 * self.part).min(self.size)
    }
}
