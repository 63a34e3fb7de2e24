//! Uploading an object while its data is still being written: the object is
//! a head whose length is reserved in advance (its bytes come last) followed
//! by the bytes a writer appends to a file. Parts 2.. go up as the file grows;
//! part 1, the head and the data's first bytes, goes up once the writer has
//! finished. A `planes` anchor is such an object: its header needs every
//! chunk's compressed size, but its length is known before the first chunk is
//! compressed (`codec::planes_prefix_len`), so compression and upload overlap
//! from the first chunk on.
//!
//! Every part but the last is [`PART_SIZE`] bytes, as in any other upload
//! (stores such as R2 require equal parts). Backends whose multipart API takes
//! parts in any order (S3, GCS, Azure, memory) stream; the others (local
//! files, WebDAV) upload the finished file ([`Store::can_put_growing`]).

use std::io::Write;
use std::path::{Path as FsPath, PathBuf};

use bytes::Bytes;
use object_store::multipart::PartId;
use object_store::path::Path;
use object_store::{MultipartId, PutPayload};
use tokio::sync::{OwnedSemaphorePermit, watch};
use tokio::task::JoinSet;

use super::{PART_CONCURRENCY, PART_SIZE, Parts, Source, Store};
use crate::error::{Error, Result};

/// What the writer has done so far.
#[derive(Clone, Debug, Default)]
struct Growth {
    /// Data bytes in the file.
    written: u64,
    /// The head, once the writer has finished.
    head: Option<Bytes>,
}

/// The writing end: appends data to the file and tells the upload how far it
/// got. Dropped without [`GrowingWriter::finish`], the upload is aborted.
#[derive(Debug)]
pub struct GrowingWriter {
    file: std::fs::File,
    written: u64,
    tx: watch::Sender<Growth>,
}

/// The reading end, handed to [`Store::put_growing`].
#[derive(Debug)]
pub struct Growing {
    path: PathBuf,
    rx: watch::Receiver<Growth>,
}

/// A writer that appends to the (new, empty) file at `path`, and the growing
/// object it feeds.
pub fn growing(path: &FsPath) -> Result<(GrowingWriter, Growing)> {
    let file = std::fs::OpenOptions::new()
        .write(true)
        .truncate(true)
        .create(true)
        .open(path)
        .map_err(|e| Error::io(format!("opening {}", path.display()), e))?;
    let (tx, rx) = watch::channel(Growth::default());
    Ok((
        GrowingWriter {
            file,
            written: 0,
            tx,
        },
        Growing {
            path: path.to_path_buf(),
            rx,
        },
    ))
}

impl Write for GrowingWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.file.write_all(buf)?;
        self.written += buf.len() as u64;
        let w = self.written;
        self.tx.send_modify(|g| g.written = w);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl GrowingWriter {
    /// The data is complete and `head` goes before it.
    pub fn finish(self, head: Vec<u8>) {
        let head = Bytes::from(head);
        self.tx.send_modify(|g| g.head = Some(head));
    }
}

/// A part's bytes: `head` (if any), then `len` bytes of `path` from `at`.
async fn part_bytes(path: &FsPath, head: Option<Bytes>, at: u64, len: u64) -> Result<Bytes> {
    let path = path.to_path_buf();
    tokio::task::spawn_blocking(move || {
        use std::os::unix::fs::FileExt;
        let io = |e| Error::io(format!("reading {}", path.display()), e);
        let f = std::fs::File::open(&path).map_err(io)?;
        let h = head.as_ref().map_or(0, Bytes::len);
        let mut buf = vec![0u8; h + len as usize];
        if let Some(head) = &head {
            buf[..h].copy_from_slice(head);
        }
        f.read_exact_at(&mut buf[h..], at).map_err(io)?;
        Ok(Bytes::from(buf))
    })
    .await
    .map_err(|e| Error::io("reading an upload part", std::io::Error::other(e)))?
}

/// BLAKE3 of `head` then the first `len` bytes of `path` (all of it).
async fn hash_object(path: &FsPath, head: Bytes, len: u64) -> Result<String> {
    let path = path.to_path_buf();
    tokio::task::spawn_blocking(move || {
        let io = |e| Error::io(format!("reading {}", path.display()), e);
        let on_disk = std::fs::metadata(&path).map_err(io)?.len();
        if on_disk != len {
            return Err(Error::io(
                format!("reading {}", path.display()),
                std::io::Error::other(format!("{on_disk} bytes where {len} were written")),
            ));
        }
        let mut h = blake3::Hasher::new();
        h.update(&head);
        h.update_mmap_rayon(&path).map_err(io)?;
        Ok(h.finalize().to_hex().to_string())
    })
    .await
    .map_err(|e| Error::io("hashing an upload", std::io::Error::other(e)))?
}

/// What sending one part gives: its index and id.
type PartResult = std::result::Result<(usize, PartId), object_store::Error>;

/// The parts of one upload in flight.
struct Sending<'a> {
    store: &'a Store,
    parts: &'a Parts,
    key: &'a str,
    path: Path,
    id: MultipartId,
    tasks: JoinSet<PartResult>,
    done: Vec<(usize, PartId)>,
}

impl Sending<'_> {
    async fn collect_one(&mut self) -> Result<()> {
        let r = self.tasks.join_next().await;
        self.collected(r)
    }

    /// Records a part's outcome (`None`: none was left).
    fn collected(
        &mut self,
        r: Option<std::result::Result<PartResult, tokio::task::JoinError>>,
    ) -> Result<()> {
        match r {
            Some(Ok(Ok(p))) => {
                self.done.push(p);
                Ok(())
            }
            Some(Ok(Err(e))) => Err(self.store.err("upload part", self.key, e)),
            Some(Err(e)) => Err(Error::io(
                format!("uploading a part of {}", self.key),
                std::io::Error::other(e),
            )),
            None => Ok(()),
        }
    }

    /// A place in the store's part budget ([`Parts::budget`]), taken before
    /// a part's bytes are read; parts of this upload that have finished
    /// meanwhile are collected (a failed one ends the upload).
    async fn permit(&mut self) -> Result<OwnedSemaphorePermit> {
        loop {
            while let Some(r) = self.tasks.try_join_next() {
                self.collected(Some(r))?;
            }
            if self.tasks.len() < PART_CONCURRENCY
                && let Ok(p) = self.parts.budget.clone().try_acquire_owned()
            {
                return Ok(p);
            }
            // Wait for a part of this upload, or for a place another upload
            // gives back, whichever comes first.
            if self.tasks.is_empty() {
                return Ok(self
                    .parts
                    .budget
                    .clone()
                    .acquire_owned()
                    .await
                    .expect("the budget is never closed"));
            }
            tokio::select! {
                r = self.tasks.join_next() => self.collected(r)?,
                p = self.parts.budget.clone().acquire_owned(), if self.tasks.len() < PART_CONCURRENCY => {
                    return Ok(p.expect("the budget is never closed"));
                }
            }
        }
    }

    /// Sends part `idx`, holding `permit` until it is up.
    async fn send(&mut self, idx: usize, bytes: Bytes, permit: OwnedSemaphorePermit) -> Result<()> {
        if let Some(p) = &self.store.progress {
            p.started(self.key, bytes.len() as u64);
            p.advanced(bytes.len() as u64);
        }
        let (store, path, id) = (self.parts.store.clone(), self.path.clone(), self.id.clone());
        self.tasks.spawn(async move {
            let part = store
                .put_part(&path, &id, idx, PutPayload::from(bytes))
                .await?;
            drop(permit);
            Ok((idx, part))
        });
        Ok(())
    }

    async fn finish(mut self) -> Result<()> {
        while !self.tasks.is_empty() {
            self.collect_one().await?;
        }
        self.done.sort_by_key(|(i, _)| *i);
        debug_assert!(self.done.iter().enumerate().all(|(k, (i, _))| k == *i));
        let parts = self.done.drain(..).map(|(_, p)| p).collect();
        self.parts
            .store
            .complete_multipart(&self.path, &self.id, parts)
            .await
            .map_err(|e| self.store.err("complete multipart upload", self.key, e))?;
        Ok(())
    }

    async fn abort(mut self) {
        self.tasks.abort_all();
        while self.tasks.join_next().await.is_some() {}
        self.parts
            .store
            .abort_multipart(&self.path, &self.id)
            .await
            .ok();
    }
}

impl Store {
    /// Whether [`Store::put_growing`] streams on this backend (its multipart
    /// API takes parts in any order) rather than waiting for the writer.
    pub fn can_put_growing(&self) -> bool {
        self.parts.is_some()
    }

    /// Uploads `key` = a head of exactly `head_len` bytes, then everything the
    /// writer of `growing` appends to its file, while it is being written:
    /// parts 2.. as the file grows, part 1 (the head and the first data
    /// bytes) once the writer has finished. Returns the object's size and
    /// BLAKE3 (hashed from the file once it is complete, alongside the last
    /// parts). A writer that stops without finishing, a head of another
    /// length, or a failed part aborts the upload. Backends without such
    /// parts, and objects that turn out small, are uploaded whole once the
    /// writer has finished.
    pub async fn put_growing(
        &self,
        key: &str,
        head_len: usize,
        growing: Growing,
    ) -> Result<(u64, String)> {
        let Growing { path: file, mut rx } = growing;
        let first_data = PART_SIZE.checked_sub(head_len).filter(|&d| d > 0);
        let (Some(parts), Some(first_data)) = (self.parts.as_ref(), first_data) else {
            let (head, len) = wait_for_end(&mut rx, key).await?;
            return self.put_whole(key, head_len, head, &file, len).await;
        };
        let first_data = first_data as u64;
        let path = Self::path(key)?;
        let mut sending: Option<Sending<'_>> = None;
        // Offset in the file of the next middle part, and its index.
        let (mut next, mut idx) = (first_data, 1usize);
        let end = loop {
            let g = rx.borrow_and_update().clone();
            while g.written >= next + PART_SIZE as u64 {
                if sending.is_none() {
                    let full = parts.full(&path);
                    let id = parts
                        .store
                        .create_multipart(&full)
                        .await
                        .map_err(|e| self.err("start multipart upload", key, e))?;
                    sending = Some(Sending {
                        store: self,
                        parts,
                        key,
                        path: full,
                        id,
                        tasks: JoinSet::new(),
                        done: Vec::new(),
                    });
                }
                let s = sending.as_mut().expect("started");
                let r = match s.permit().await {
                    Ok(permit) => match part_bytes(&file, None, next, PART_SIZE as u64).await {
                        Ok(bytes) => s.send(idx, bytes, permit).await,
                        Err(e) => Err(e),
                    },
                    Err(e) => Err(e),
                };
                if let Err(e) = r {
                    sending.take().expect("started").abort().await;
                    return Err(e);
                }
                tracing::debug!(
                    key,
                    part = idx,
                    written = g.written,
                    "growing upload: part queued"
                );
                next += PART_SIZE as u64;
                idx += 1;
            }
            if let Some(head) = g.head {
                break Ok((head, g.written));
            }
            if rx.changed().await.is_err() && rx.borrow().head.is_none() {
                break Err(writer_stopped(key));
            }
        };
        let Some(mut s) = sending else {
            let (head, len) = end?;
            return self.put_whole(key, head_len, head, &file, len).await;
        };
        match self
            .send_the_rest(&mut s, end, head_len, &file, (next, idx, first_data))
            .await
        {
            Ok((size, hash)) => {
                s.finish().await?;
                Ok((size, hash))
            }
            Err(e) => {
                s.abort().await;
                Err(e)
            }
        }
    }

    /// The last part and part 1 of a growing upload, and the object's hash.
    async fn send_the_rest(
        &self,
        s: &mut Sending<'_>,
        end: Result<(Bytes, u64)>,
        head_len: usize,
        file: &FsPath,
        (next, idx, first_data): (u64, usize, u64),
    ) -> Result<(u64, String)> {
        let (head, len) = end?;
        tracing::debug!(key = s.key, len, "growing upload: writer finished");
        if head.len() != head_len {
            return Err(wrong_head(s.key, head.len(), head_len));
        }
        let hash = tokio::spawn({
            let (file, head) = (file.to_path_buf(), head.clone());
            async move { hash_object(&file, head, len).await }
        });
        if len > next {
            let permit = s.permit().await?;
            s.send(idx, part_bytes(file, None, next, len - next).await?, permit)
                .await?;
        }
        let permit = s.permit().await?;
        s.send(
            0,
            part_bytes(file, Some(head), 0, first_data).await?,
            permit,
        )
        .await?;
        let hash = hash
            .await
            .map_err(|e| Error::io("hashing an upload", std::io::Error::other(e)))??;
        Ok((head_len as u64 + len, hash))
    }

    /// The whole object at once, once the writer has finished.
    async fn put_whole(
        &self,
        key: &str,
        head_len: usize,
        head: Bytes,
        file: &FsPath,
        len: u64,
    ) -> Result<(u64, String)> {
        if head.len() != head_len {
            return Err(wrong_head(key, head.len(), head_len));
        }
        let sources = [
            Source::Bytes(head),
            Source::File {
                path: file.to_path_buf(),
                offset: 0,
                len,
            },
        ];
        self.put_sources(key, &sources).await
    }
}

/// Waits until the writer has finished: its head and data length.
async fn wait_for_end(rx: &mut watch::Receiver<Growth>, key: &str) -> Result<(Bytes, u64)> {
    loop {
        let g = rx.borrow_and_update().clone();
        if let Some(head) = g.head {
            return Ok((head, g.written));
        }
        if rx.changed().await.is_err() && rx.borrow().head.is_none() {
            return Err(writer_stopped(key));
        }
    }
}

fn writer_stopped(key: &str) -> Error {
    Error::io(
        format!("uploading {key}"),
        std::io::Error::other("its writer stopped before the object was complete"),
    )
}

fn wrong_head(key: &str, got: usize, want: usize) -> Error {
    Error::io(
        format!("uploading {key}"),
        std::io::Error::other(format!(
            "its head is {got} bytes where {want} were reserved"
        )),
    )
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU64, Ordering};

    use super::*;
    use crate::store::Progress;

    #[derive(Debug, Default)]
    struct Sent(AtomicU64);

    impl Progress for Sent {
        fn started(&self, _: &str, _: u64) {}
        fn advanced(&self, bytes: u64) {
            self.0.fetch_add(bytes, Ordering::SeqCst);
        }
    }

    /// Parts go up while the writer is still writing: the writer waits, before
    /// it finishes, for a whole part to have been sent.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn parts_go_up_before_the_writer_finishes() {
        let sent = Arc::new(Sent::default());
        let store = Store::open("memory:///g")
            .unwrap()
            .with_progress(sent.clone());
        assert!(store.can_put_growing());
        let dir = tempfile::tempdir().unwrap();
        let (mut w, g) = growing(&dir.path().join("spill")).unwrap();
        let data = vec![9u8; 2 * PART_SIZE + 1];
        let feed = {
            let (data, sent) = (data.clone(), sent.clone());
            std::thread::spawn(move || {
                w.write_all(&data).unwrap();
                let t = std::time::Instant::now();
                while sent.0.load(Ordering::SeqCst) < PART_SIZE as u64 {
                    assert!(
                        t.elapsed() < std::time::Duration::from_secs(60),
                        "no part was sent before the writer finished"
                    );
                    std::thread::sleep(std::time::Duration::from_millis(2));
                }
                w.finish(b"head".to_vec());
            })
        };
        let (size, hash) = store.put_growing("o", 4, g).await.unwrap();
        feed.join().unwrap();
        let mut whole = b"head".to_vec();
        whole.extend_from_slice(&data);
        assert_eq!(size, whole.len() as u64);
        assert_eq!(hash, blake3::hash(&whole).to_hex().to_string());
        assert_eq!(store.get("o").await.unwrap().unwrap()[..], whole[..]);
        assert_eq!(sent.0.load(Ordering::SeqCst), whole.len() as u64);
    }

    /// A head of another length than reserved fails the upload (with the
    /// parts already sent, and without), leaving no object; so does a head
    /// too large for the first part.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_head_of_the_wrong_length_leaves_no_object() {
        let store = Store::open("memory:///g").unwrap();
        let dir = tempfile::tempdir().unwrap();
        for len in [10, 2 * PART_SIZE] {
            let (mut w, g) = growing(&dir.path().join("spill")).unwrap();
            w.write_all(&vec![1u8; len]).unwrap();
            w.finish(b"12345".to_vec());
            let e = store.put_growing("o", 4, g).await.unwrap_err();
            assert!(
                e.to_string().contains("5 bytes where 4 were reserved"),
                "{e}"
            );
            assert_eq!(store.get("o").await.unwrap(), None);
        }
        let (mut w, g) = growing(&dir.path().join("spill")).unwrap();
        w.write_all(b"data").unwrap();
        w.finish(vec![0u8; PART_SIZE]);
        let (size, _) = store.put_growing("big-head", PART_SIZE, g).await.unwrap();
        assert_eq!(size, PART_SIZE as u64 + 4);
    }

    /// A local store has no out-of-order parts: the object goes up whole once
    /// the writer has finished, with the same bytes.
    #[tokio::test]
    async fn stores_without_parts_upload_the_finished_object() {
        let bucket = tempfile::tempdir().unwrap();
        let store = Store::open(&format!("file://{}", bucket.path().display())).unwrap();
        assert!(!store.can_put_growing());
        let dir = tempfile::tempdir().unwrap();
        let (mut w, g) = growing(&dir.path().join("spill")).unwrap();
        w.write_all(b"payload").unwrap();
        w.finish(b"hd".to_vec());
        let (size, hash) = store.put_growing("o", 2, g).await.unwrap();
        assert_eq!(
            (size, hash),
            (9, blake3::hash(b"hdpayload").to_hex().to_string())
        );
        assert_eq!(store.get("o").await.unwrap().unwrap()[..], b"hdpayload"[..]);
    }

    /// Parts in flight through a multipart store, counted (each part held
    /// a while, so that uploads overlap).
    struct Counting {
        inner: Arc<dyn object_store::multipart::MultipartStore>,
        now: AtomicU64,
        peak: AtomicU64,
    }

    #[async_trait::async_trait]
    impl object_store::multipart::MultipartStore for Counting {
        async fn create_multipart(&self, path: &Path) -> object_store::Result<MultipartId> {
            self.inner.create_multipart(path).await
        }
        async fn put_part(
            &self,
            path: &Path,
            id: &MultipartId,
            idx: usize,
            data: PutPayload,
        ) -> object_store::Result<PartId> {
            let n = self.now.fetch_add(1, Ordering::SeqCst) + 1;
            self.peak.fetch_max(n, Ordering::SeqCst);
            tokio::time::sleep(std::time::Duration::from_millis(200)).await;
            let r = self.inner.put_part(path, id, idx, data).await;
            self.now.fetch_sub(1, Ordering::SeqCst);
            r
        }
        async fn complete_multipart(
            &self,
            path: &Path,
            id: &MultipartId,
            parts: Vec<PartId>,
        ) -> object_store::Result<object_store::PutResult> {
            self.inner.complete_multipart(path, id, parts).await
        }
        async fn abort_multipart(&self, path: &Path, id: &MultipartId) -> object_store::Result<()> {
            self.inner.abort_multipart(path, id).await
        }
    }

    /// Three growing uploads at once through one store (and its clones)
    /// share one part budget: never more than `PART_CONCURRENCY` parts in
    /// flight in all, and each object arrives whole.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn overlapping_growing_uploads_share_one_part_budget() {
        let mut store = Store::open("memory:///g").unwrap();
        let parts = store.parts.clone().expect("memory takes parts");
        let counting = Arc::new(Counting {
            inner: parts.store.clone(),
            now: AtomicU64::new(0),
            peak: AtomicU64::new(0),
        });
        store.parts = Some(Parts {
            store: counting.clone(),
            ..parts.clone()
        });
        let dir = tempfile::tempdir().unwrap();
        let mut uploads = Vec::new();
        let mut expected = Vec::new();
        for k in 0..3u8 {
            let (mut w, g) = growing(&dir.path().join(format!("spill{k}"))).unwrap();
            let data = vec![k + 1; 5 * PART_SIZE + 7];
            let mut whole = vec![b'h', k];
            whole.extend_from_slice(&data);
            expected.push(whole);
            std::thread::spawn(move || {
                w.write_all(&data).unwrap();
                w.finish(vec![b'h', k]);
            });
            let s = store.clone();
            uploads.push(tokio::spawn(async move {
                s.put_growing(&format!("o{k}"), 2, g).await
            }));
        }
        for (k, u) in uploads.into_iter().enumerate() {
            let (size, hash) = u.await.unwrap().unwrap();
            assert_eq!(size, expected[k].len() as u64);
            assert_eq!(hash, blake3::hash(&expected[k]).to_hex().to_string());
            let back = store.get(&format!("o{k}")).await.unwrap().unwrap();
            assert!(back[..] == expected[k][..], "object {k} differs");
        }
        let peak = counting.peak.load(Ordering::SeqCst);
        // 18 parts in all; with a budget per upload the peak would be 18.
        assert!(
            peak >= 2 && peak <= PART_CONCURRENCY as u64,
            "{peak} parts in flight at once"
        );
        assert_eq!(
            parts.budget.available_permits(),
            PART_CONCURRENCY,
            "every place given back"
        );
    }
}
