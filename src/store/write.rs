//! Writing: plain and multipart puts (from memory, a file, or pieces of
//! both), conditional creates, deletes, and the probe for stores that ignore
//! conditional writes.

use bytes::Bytes;
use object_store::path::Path;
use object_store::{ObjectStoreExt, PutMode, PutPayload, WriteMultipart};

use super::{
    ConditionalWrites, Created, MULTIPART_THRESHOLD, PART_CONCURRENCY, PART_SIZE, Source, Store,
};
use crate::error::{Error, Result};

/// Bytes read from a file per step of an upload.
const READ_STEP: u64 = 8 << 20;

impl Store {
    /// Starts a multipart upload to `path` (`key`) in [`PART_SIZE`] parts.
    pub(super) async fn multipart(&self, path: &Path, key: &str) -> Result<WriteMultipart> {
        let upload = self
            .inner
            .put_multipart(path)
            .await
            .map_err(|e| self.err("start multipart upload", key, e))?;
        Ok(WriteMultipart::new_with_chunk_size(upload, PART_SIZE))
    }

    /// Writes an object, overwriting any previous one. Objects of
    /// [`MULTIPART_THRESHOLD`] bytes or more go up in [`PART_SIZE`] parts,
    /// [`PART_CONCURRENCY`] at a time; an incomplete upload is aborted.
    pub async fn put(&self, key: &str, bytes: Bytes) -> Result<()> {
        let path = Self::path(key)?;
        let len = bytes.len() as u64;
        if let Some(p) = &self.progress {
            p.started(key, len);
        }
        if bytes.len() < MULTIPART_THRESHOLD {
            self.inner
                .put(&path, PutPayload::from(bytes))
                .await
                .map_err(|e| self.err("put", key, e))?;
            if let Some(p) = &self.progress {
                p.advanced(len);
            }
            return Ok(());
        }
        let mut writer = self.multipart(&path, key).await?;
        for chunk in bytes.chunks(PART_SIZE) {
            writer
                .wait_for_capacity(PART_CONCURRENCY)
                .await
                .map_err(|e| self.err("upload part", key, e))?;
            writer.put(bytes.slice_ref(chunk));
            if let Some(p) = &self.progress {
                p.advanced(chunk.len() as u64);
            }
        }
        writer
            .finish()
            .await
            .map_err(|e| self.err("complete multipart upload", key, e))?;
        Ok(())
    }

    /// Uploads the file at `path` as an object, reading it part by part: memory
    /// stays at about ([`PART_CONCURRENCY`] + 1) × [`PART_SIZE`] whatever the
    /// file's size (multi-GB anchors). The file must not change meanwhile; the
    /// caller's manifest entry (size, BLAKE3) is what readers check.
    pub async fn put_file(&self, key: &str, path: &std::path::Path) -> Result<()> {
        use tokio::io::AsyncReadExt;
        let io = |e| Error::io(format!("reading {}", path.display()), e);
        let mut file = tokio::fs::File::open(path).await.map_err(io)?;
        let len = file.metadata().await.map_err(io)?.len();
        if len < MULTIPART_THRESHOLD as u64 {
            let mut buf = Vec::with_capacity(len as usize);
            file.read_to_end(&mut buf).await.map_err(io)?;
            return self.put(key, Bytes::from(buf)).await;
        }
        let p = Self::path(key)?;
        if let Some(pr) = &self.progress {
            pr.started(key, len);
        }
        let mut writer = self.multipart(&p, key).await?;
        let mut sent = 0u64;
        loop {
            let mut part = Vec::with_capacity(PART_SIZE);
            let n = (&mut file)
                .take(PART_SIZE as u64)
                .read_to_end(&mut part)
                .await
                .map_err(io)?;
            if n == 0 {
                break;
            }
            sent += n as u64;
            if let Err(e) = writer.wait_for_capacity(PART_CONCURRENCY).await {
                writer.abort().await.ok();
                return Err(self.err("upload part", key, e));
            }
            writer.put(Bytes::from(part));
            if let Some(pr) = &self.progress {
                pr.advanced(n as u64);
            }
        }
        if sent != len {
            writer.abort().await.ok();
            return Err(Error::io(
                format!("reading {}", path.display()),
                std::io::Error::other(format!(
                    "file changed size during upload ({len} → {sent} bytes)"
                )),
            ));
        }
        writer
            .finish()
            .await
            .map_err(|e| self.err("complete multipart upload", key, e))?;
        Ok(())
    }

    /// Uploads the concatenation of `sources` as one object and returns its
    /// size and BLAKE3 (hashed as the bytes go out). File pieces are read in
    /// steps of 8 MiB when their turn comes, and at most
    /// [`PART_CONCURRENCY`] parts of [`PART_SIZE`] are in flight: memory stays
    /// bounded whatever the object's size. A file that is shorter than
    /// announced fails the upload, which is then aborted.
    pub async fn put_sources(&self, key: &str, sources: &[Source]) -> Result<(u64, String)> {
        let total: u64 = sources.iter().map(Source::len).sum();
        let mut hasher = blake3::Hasher::new();
        if total < MULTIPART_THRESHOLD as u64 {
            let mut buf = Vec::with_capacity(total as usize);
            for s in sources {
                let mut at = 0;
                while at < s.len() {
                    let chunk = read_source(s, at, s.len() - at).await?;
                    at += chunk.len() as u64;
                    buf.extend_from_slice(&chunk);
                }
            }
            hasher.update(&buf);
            self.put(key, Bytes::from(buf)).await?;
            return Ok((total, hasher.finalize().to_hex().to_string()));
        }
        let path = Self::path(key)?;
        if let Some(p) = &self.progress {
            p.started(key, total);
        }
        let mut writer = self.multipart(&path, key).await?;
        for s in sources {
            let mut at = 0;
            while at < s.len() {
                let chunk = match read_source(s, at, READ_STEP.min(s.len() - at)).await {
                    Ok(c) => c,
                    Err(e) => {
                        writer.abort().await.ok();
                        return Err(e);
                    }
                };
                at += chunk.len() as u64;
                crate::digest::blake3_update(&mut hasher, &chunk);
                if let Err(e) = writer.wait_for_capacity(PART_CONCURRENCY).await {
                    writer.abort().await.ok();
                    return Err(self.err("upload part", key, e));
                }
                if let Some(p) = &self.progress {
                    p.advanced(chunk.len() as u64);
                }
                writer.put(chunk);
            }
        }
        writer
            .finish()
            .await
            .map_err(|e| self.err("complete multipart upload", key, e))?;
        Ok((total, hasher.finalize().to_hex().to_string()))
    }

    /// Creates an object only if the key is free (`If-None-Match: *` or the
    /// store's equivalent). Stores that ignore the condition report `Created`
    /// for both racers: see [`Store::probe_conditional_writes`].
    pub async fn create(&self, key: &str, bytes: Bytes) -> Result<Created> {
        let path = Self::path(key)?;
        match self
            .inner
            .put_opts(&path, PutPayload::from(bytes), PutMode::Create.into())
            .await
        {
            Ok(_) => Ok(Created::Created),
            Err(object_store::Error::AlreadyExists { .. }) => Ok(Created::AlreadyExists),
            Err(object_store::Error::Precondition { .. }) => Ok(Created::AlreadyExists),
            Err(e) => Err(self.err("create", key, e)),
        }
    }

    /// Deletes an object (missing objects are not an error).
    pub async fn delete(&self, key: &str) -> Result<()> {
        let path = Self::path(key)?;
        match self.inner.delete(&path).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(self.err("delete", key, e)),
        }
    }

    /// Finds out whether the store really enforces create-if-absent: creates a
    /// fresh probe key twice and checks that the second create was refused and
    /// the first bytes survived. Some S3-compatible stores (Garage 2.5) and
    /// emulators (fake-gcs-server) accept the request and overwrite.
    pub async fn probe_conditional_writes(&self) -> Result<ConditionalWrites> {
        let nonce = blake3::hash(
            format!("{:?}/{}", std::time::SystemTime::now(), std::process::id()).as_bytes(),
        );
        let key = format!("_weightcast/probe/{}", &nonce.to_hex()[..16]);
        let first = self.create(&key, Bytes::from_static(b"first")).await?;
        if first != Created::Created {
            return Err(Error::Config(format!(
                "conditional-write probe: fresh key `{key}` reported as existing"
            )));
        }
        let second = self.create(&key, Bytes::from_static(b"second")).await?;
        let kept = self.get(&key).await?;
        self.delete(&key).await?;
        Ok(match (second, kept.as_deref()) {
            (Created::AlreadyExists, Some(b"first")) => ConditionalWrites::Enforced,
            _ => ConditionalWrites::Ignored,
        })
    }
}

/// Reads up to `len` bytes of `s` from `at` (all of them, or an error).
async fn read_source(s: &Source, at: u64, len: u64) -> Result<Bytes> {
    match s {
        Source::Bytes(b) => Ok(b.slice(at as usize..(at + len) as usize)),
        Source::File { path, offset, .. } => {
            let (path, pos) = (path.clone(), offset + at);
            tokio::task::spawn_blocking(move || {
                use std::os::unix::fs::FileExt;
                let io = |e| Error::io(format!("reading {}", path.display()), e);
                let f = std::fs::File::open(&path).map_err(io)?;
                let mut buf = vec![0u8; len as usize];
                f.read_exact_at(&mut buf, pos).map_err(io)?;
                Ok(Bytes::from(buf))
            })
            .await
            .map_err(|e| Error::io("reading an upload source", std::io::Error::other(e)))?
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use futures::stream::BoxStream;
    use object_store::memory::InMemory;
    use object_store::{
        CopyOptions, GetOptions, GetResult, ListResult, MultipartUpload, ObjectMeta, ObjectStore,
        PutMultipartOptions, PutOptions, PutResult,
    };

    /// A store that behaves like Garage 2.5: it accepts conditional puts and
    /// overwrites anyway. (The real-server check against fake-gcs-server, which
    /// does the same, is for when object_store can write to it; see the notes.)
    #[derive(Debug)]
    struct IgnoresConditions(InMemory);

    impl std::fmt::Display for IgnoresConditions {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "IgnoresConditions")
        }
    }

    #[async_trait::async_trait]
    impl ObjectStore for IgnoresConditions {
        async fn put_opts(
            &self,
            location: &Path,
            payload: PutPayload,
            mut opts: PutOptions,
        ) -> object_store::Result<PutResult> {
            opts.mode = PutMode::Overwrite;
            self.0.put_opts(location, payload, opts).await
        }
        async fn put_multipart_opts(
            &self,
            location: &Path,
            opts: PutMultipartOptions,
        ) -> object_store::Result<Box<dyn MultipartUpload>> {
            self.0.put_multipart_opts(location, opts).await
        }
        async fn get_opts(
            &self,
            location: &Path,
            options: GetOptions,
        ) -> object_store::Result<GetResult> {
            self.0.get_opts(location, options).await
        }
        fn delete_stream(
            &self,
            locations: BoxStream<'static, object_store::Result<Path>>,
        ) -> BoxStream<'static, object_store::Result<Path>> {
            self.0.delete_stream(locations)
        }
        fn list(
            &self,
            prefix: Option<&Path>,
        ) -> BoxStream<'static, object_store::Result<ObjectMeta>> {
            self.0.list(prefix)
        }
        async fn list_with_delimiter(
            &self,
            prefix: Option<&Path>,
        ) -> object_store::Result<ListResult> {
            self.0.list_with_delimiter(prefix).await
        }
        async fn copy_opts(
            &self,
            from: &Path,
            to: &Path,
            options: CopyOptions,
        ) -> object_store::Result<()> {
            self.0.copy_opts(from, to, options).await
        }
    }

    #[tokio::test]
    async fn probe_detects_a_store_that_ignores_conditions() {
        let lying =
            Store::from_object_store(Arc::new(IgnoresConditions(InMemory::new())), "lying://");
        assert_eq!(
            lying.probe_conditional_writes().await.unwrap(),
            ConditionalWrites::Ignored
        );
        // Both racers think they won: exactly what the probe protects against.
        assert_eq!(
            lying.create("k", Bytes::from_static(b"1")).await.unwrap(),
            Created::Created
        );
        assert_eq!(
            lying.create("k", Bytes::from_static(b"2")).await.unwrap(),
            Created::Created
        );
        let honest = Store::open("memory://").unwrap();
        assert_eq!(
            honest.probe_conditional_writes().await.unwrap(),
            ConditionalWrites::Enforced
        );
        // The probe leaves nothing behind.
        assert!(honest.list("").await.unwrap().is_empty());
    }
}
