//! Reading: whole objects (bounded, conditional on an ETag), sizes, ranged
//! reads and concurrent ranged downloads, listings.

use bytes::Bytes;
use futures::TryStreamExt;
use object_store::path::Path;
use object_store::{GetOptions, ObjectStoreExt};

use super::{Fetched, Listed, PART_SIZE, Store};
use crate::error::{Error, Result};

impl Store {
    /// Collects a listing, sorted by key.
    async fn collect_listing(
        &self,
        stream: futures::stream::BoxStream<'static, object_store::Result<object_store::ObjectMeta>>,
        prefix: &str,
    ) -> Result<Vec<Listed>> {
        let mut out: Vec<Listed> = stream
            .map_ok(|m| Listed {
                key: m.location.to_string(),
                size: m.size,
            })
            .try_collect()
            .await
            .map_err(|e| self.err("list", prefix, e))?;
        out.sort_by(|a, b| a.key.cmp(&b.key));
        Ok(out)
    }

    /// Reads an object; `None` when it does not exist.
    pub async fn get(&self, key: &str) -> Result<Option<Bytes>> {
        self.get_at_most(key, u64::MAX).await
    }

    /// Reads an object of at most `max` bytes; `None` when it does not exist.
    /// A larger object is refused from its reported size, before its body is
    /// read: a bucket object cannot make the reader buffer more than `max`.
    pub async fn get_at_most(&self, key: &str, max: u64) -> Result<Option<Bytes>> {
        match self.fetch_at_most(key, None, max).await? {
            Fetched::Body { bytes, .. } => Ok(Some(bytes)),
            Fetched::Missing => Ok(None),
            Fetched::NotModified => unreachable!("no ETag was given"),
        }
    }

    /// Reads an object unless it still has ETag `known` (a conditional GET: one
    /// small request per poll, and no body when nothing changed).
    pub async fn fetch(&self, key: &str, known: Option<&str>) -> Result<Fetched> {
        self.fetch_at_most(key, known, u64::MAX).await
    }

    /// [`Store::fetch`], refusing an object larger than `max` bytes before
    /// reading its body.
    pub async fn fetch_at_most(&self, key: &str, known: Option<&str>, max: u64) -> Result<Fetched> {
        let path = Self::path(key)?;
        let opts = GetOptions {
            if_none_match: known.map(str::to_string),
            ..GetOptions::default()
        };
        match self.inner.get_opts(&path, opts).await {
            Ok(r) => {
                if r.meta.size > max {
                    return Err(Error::TooLarge {
                        key: key.to_string(),
                        size: r.meta.size,
                        max,
                    });
                }
                let etag = r.meta.e_tag.clone();
                let bytes = r.bytes().await.map_err(|e| self.err("read", key, e))?;
                if bytes.len() as u64 > max {
                    return Err(Error::TooLarge {
                        key: key.to_string(),
                        size: bytes.len() as u64,
                        max,
                    });
                }
                Ok(Fetched::Body { bytes, etag })
            }
            Err(object_store::Error::NotFound { .. }) => Ok(Fetched::Missing),
            Err(object_store::Error::NotModified { .. }) => Ok(Fetched::NotModified),
            Err(e) => Err(self.err("read", key, e)),
        }
    }

    /// The size of an object (a HEAD request); `None` when it does not exist.
    pub async fn head(&self, key: &str) -> Result<Option<u64>> {
        let path = Self::path(key)?;
        match self.inner.head(&path).await {
            Ok(meta) => Ok(Some(meta.size)),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(self.err("head", key, e)),
        }
    }

    /// Reads bytes `range` of an object (a ranged GET). An object that ends
    /// before `range.end`, or a store that answers with another length, is an
    /// error naming the key: a reader never mistakes a short read for data.
    pub async fn get_range(&self, key: &str, range: std::ops::Range<u64>) -> Result<Bytes> {
        let path = Self::path(key)?;
        let want = range.end.saturating_sub(range.start);
        match self.inner.get_range(&path, range.clone()).await {
            Ok(b) if b.len() as u64 == want => Ok(b),
            Ok(b) => Err(Error::Integrity {
                scope: format!(
                    "object {key} at `{}`, bytes {}..{}",
                    self.url, range.start, range.end
                ),
                expected: format!("{want} bytes"),
                actual: format!("{} bytes", b.len()),
            }),
            Err(object_store::Error::NotFound { .. }) => Err(Error::NotFound(format!(
                "object `{key}` is missing from `{}`",
                self.url
            ))),
            Err(e) => Err(self.err("read range of", key, e)),
        }
    }

    /// Downloads an object of `size` bytes (as a manifest declares it) as
    /// concurrent ranged GETs of `part` bytes, at most `concurrency` in
    /// flight, handing the bytes to `sink(offset, bytes)` as they arrive —
    /// in pieces, in any order, each byte of `0..size` exactly once —
    /// typically a write at that offset in a file. Each part is streamed,
    /// not buffered: memory stays at a few network chunks (or a 1 MiB read
    /// buffer for local files) per part in flight, whatever the object's
    /// size. Returns the number of requests made. An object the store
    /// reports at another size is refused at the first answer, before any
    /// byte reaches `sink` (an [`Error::Integrity`] naming the key), as is
    /// a `size` over [`Store::max_object_size`]; the caller checks what it
    /// assembled (BLAKE3). `done(range)` is called once each part's bytes
    /// have all gone to `sink` (a reader that follows the download).
    pub async fn download_ranges<F, D>(
        &self,
        key: &str,
        size: u64,
        part: u64,
        concurrency: usize,
        sink: F,
        done: D,
    ) -> Result<u64>
    where
        F: Fn(u64, &[u8]) -> Result<()> + Sync,
        D: Fn(std::ops::Range<u64>),
    {
        use futures::StreamExt;
        let path = Self::path(key)?;
        if size > self.max_object_size {
            return Err(Error::TooLarge {
                key: key.to_string(),
                size,
                max: self.max_object_size,
            });
        }
        let part = part.max(1);
        let parts = size.div_ceil(part);
        if let Some(p) = &self.download {
            p.started(key, size);
        }
        let progress = self.download.as_deref();
        let sink = move |at: u64, b: &[u8]| {
            sink(at, b)?;
            if let Some(p) = progress {
                p.advanced(b.len() as u64);
            }
            Ok(())
        };
        let (path, sink) = (&path, &sink);
        let range = |i: u64| i * part..((i + 1) * part).min(size);
        // The first part alone: its answer says whether the object is the
        // declared size before the other parts are asked for.
        if parts > 0 {
            self.stream_range(key, path, size, range(0), sink).await?;
            done(range(0));
        }
        let mut fetched = futures::stream::iter(1..parts)
            .map(|i| async move {
                self.stream_range(key, path, size, range(i), sink)
                    .await
                    .map(|()| range(i))
            })
            .buffer_unordered(concurrency.max(1));
        while let Some(r) = fetched.next().await {
            done(r?);
        }
        Ok(parts)
    }

    /// [`Store::download_ranges`] into `file`, each byte written at its
    /// offset; `done(range)` once each part is in the file.
    pub async fn download_to(
        &self,
        key: &str,
        size: u64,
        file: &std::fs::File,
        part: u64,
        concurrency: usize,
        done: impl Fn(std::ops::Range<u64>),
    ) -> Result<u64> {
        use std::os::unix::fs::FileExt;
        let write = |at: u64, b: &[u8]| {
            file.write_all_at(b, at)
                .map_err(|e| Error::io(format!("writing object {key} at offset {at}"), e))
        };
        self.download_ranges(key, size, part, concurrency, write, done)
            .await
    }

    /// One ranged GET, streamed into `sink`.
    async fn stream_range<F>(
        &self,
        key: &str,
        path: &Path,
        size: u64,
        range: std::ops::Range<u64>,
        sink: &F,
    ) -> Result<()>
    where
        F: Fn(u64, &[u8]) -> Result<()>,
    {
        use futures::StreamExt;
        let opts = GetOptions {
            range: Some(range.clone().into()),
            ..GetOptions::default()
        };
        let r = match self.inner.get_opts(path, opts).await {
            Ok(r) => r,
            Err(object_store::Error::NotFound { .. }) => {
                return Err(Error::NotFound(format!(
                    "object `{key}` is missing from `{}`",
                    self.url
                )));
            }
            Err(e) => return Err(self.err("read range of", key, e)),
        };
        let short = |got: u64| Error::Integrity {
            scope: format!(
                "object {key} at `{}`, bytes {}..{}",
                self.url, range.start, range.end
            ),
            expected: format!("{} bytes", range.end - range.start),
            actual: format!("{got} bytes"),
        };
        // The object must be the size the caller was told (a manifest's
        // entry): refused at its first answer, before any byte is taken.
        if r.meta.size != size {
            return Err(Error::Integrity {
                scope: format!("object {key} at `{}`", self.url),
                expected: format!("{size} bytes (as declared)"),
                actual: format!("{} bytes (as stored)", r.meta.size),
            });
        }
        if r.range != range {
            return Err(short(r.range.end.saturating_sub(r.range.start)));
        }
        let mut at = range.start;
        match r.payload {
            object_store::GetResultPayload::File(file, _) => {
                // A local file: read in 1 MiB pieces (object_store's own
                // stream would read it 8 KiB at a time, a task per read).
                use std::os::unix::fs::FileExt;
                let mut buf = vec![0u8; (range.end - range.start).min(1 << 20) as usize];
                while at < range.end {
                    let n = buf.len().min((range.end - at) as usize);
                    file.read_exact_at(&mut buf[..n], at)
                        .map_err(|e| Error::io(format!("reading object {key}"), e))?;
                    sink(at, &buf[..n])?;
                    at += n as u64;
                }
            }
            object_store::GetResultPayload::Stream(mut chunks) => {
                while let Some(chunk) = chunks.next().await {
                    let chunk = chunk.map_err(|e| self.err("read range of", key, e))?;
                    if at + chunk.len() as u64 > range.end {
                        return Err(short(at + chunk.len() as u64 - range.start));
                    }
                    sink(at, &chunk)?;
                    at += chunk.len() as u64;
                }
            }
        }
        if at != range.end {
            return Err(short(at - range.start));
        }
        Ok(())
    }

    /// Lists every object under `prefix` (recursively), sorted by key.
    pub async fn list(&self, prefix: &str) -> Result<Vec<Listed>> {
        let p = if prefix.is_empty() {
            None
        } else {
            Some(Self::path(prefix)?)
        };
        self.collect_listing(self.inner.list(p.as_ref()), prefix)
            .await
    }

    /// Lists the objects under `prefix` whose keys sort after `after` (S3's
    /// `start-after`: one request however long the history before it), sorted.
    pub async fn list_after(&self, prefix: &str, after: &str) -> Result<Vec<Listed>> {
        let p = Self::path(prefix)?;
        let offset = Self::path(after)?;
        let mut out = self
            .collect_listing(self.inner.list_with_offset(Some(&p), &offset), prefix)
            .await?;
        out.retain(|l| l.key.as_str() > after);
        Ok(out)
    }

    /// The bytes of the first `size` bytes of an object as an ordered stream
    /// of pieces of at most [`PART_SIZE`], read as ranged GETs with
    /// `ahead` of them in flight: memory is about `ahead` × [`PART_SIZE`]
    /// whatever the object's size. A short object is an error naming the key.
    pub fn read_parts<'a>(
        &'a self,
        key: &'a str,
        size: u64,
        ahead: usize,
    ) -> impl futures::Stream<Item = Result<Bytes>> + 'a {
        use futures::StreamExt;
        let part = PART_SIZE as u64;
        futures::stream::iter(0..size.div_ceil(part))
            .map(move |i| self.get_range(key, i * part..((i + 1) * part).min(size)))
            .buffered(ahead.max(1))
    }

    /// Size and BLAKE3 of an object, read in parts ([`Store::read_parts`]);
    /// `None` when it does not exist.
    pub async fn measure(&self, key: &str) -> Result<Option<(u64, String)>> {
        use futures::StreamExt;
        let Some(size) = self.head(key).await? else {
            return Ok(None);
        };
        let mut hasher = blake3::Hasher::new();
        let mut parts = std::pin::pin!(self.read_parts(key, size, 2));
        while let Some(b) = parts.next().await {
            crate::digest::blake3_update(&mut hasher, &b?);
        }
        Ok(Some((size, hasher.finalize().to_hex().to_string())))
    }
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;

    use crate::error::Error;
    use crate::store::Store;

    #[tokio::test]
    async fn ranged_downloads_trust_no_declared_size() {
        let store = Store::open("memory://").unwrap();
        let body: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
        store.put("k", Bytes::from(body.clone())).await.unwrap();
        let got = std::sync::Mutex::new(vec![0u8; body.len()]);
        let sink = |at: u64, b: &[u8]| {
            got.lock().unwrap()[at as usize..at as usize + b.len()].copy_from_slice(b);
            Ok(())
        };
        // Each part reported once its bytes are all in.
        let parts = std::sync::Mutex::new(Vec::new());
        let done = |r: std::ops::Range<u64>| {
            let g = got.lock().unwrap();
            assert!(g[r.start as usize..r.end as usize] == body[r.start as usize..r.end as usize]);
            parts.lock().unwrap().push(r);
        };
        let n = store
            .download_ranges("k", body.len() as u64, 30_000, 3, sink, done)
            .await
            .unwrap();
        assert_eq!(n, 4);
        assert_eq!(*got.lock().unwrap(), body);
        let mut parts = parts.into_inner().unwrap();
        parts.sort_by_key(|r| r.start);
        assert_eq!(
            parts,
            [0..30_000, 30_000..60_000, 60_000..90_000, 90_000..100_000]
        );
        // Declared larger or smaller than stored: refused at the first
        // answer, before any byte reaches the sink.
        for declared in [10 << 30, body.len() as u64 - 1] {
            let e = store
                .download_ranges(
                    "k",
                    declared,
                    30_000,
                    3,
                    |_, _| panic!("bytes of a mis-declared object were taken"),
                    |_| {},
                )
                .await
                .unwrap_err();
            assert!(
                matches!(&e, Error::Integrity { scope, .. } if scope.contains("object k")),
                "{e}"
            );
            assert!(e.to_string().contains("100000 bytes (as stored)"), "{e}");
        }
        // Over the reader's limit: refused before any request.
        let small = store.clone().with_max_object_size(1000);
        let e = small
            .download_ranges("k", body.len() as u64, 30_000, 3, |_, _| Ok(()), |_| {})
            .await
            .unwrap_err();
        assert!(matches!(e, Error::TooLarge { .. }), "{e}");
    }
}
