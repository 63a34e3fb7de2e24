//! The `file://` backend: object_store's local filesystem, serving regular
//! files only, with every open bounded in time.
//!
//! A bucket directory is written by whoever can write the prefix, and a
//! file system can hold what no object store can: a FIFO (or a link to
//! one), a device, a socket. Opening a FIFO blocks until a writer appears —
//! for good, on a worker thread no timeout can cancel — and a device can
//! stream without end. So every read first checks, without opening it, that
//! the key names a regular file (links followed) and refuses anything else
//! with an error naming the key; and each open is bounded by
//! [`LOCAL_OPEN_TIMEOUT`] (a file system that stops answering, or a file
//! swapped for a FIFO between the check and the open).
//!
//! Deleting an object removes the directories it leaves empty (object_store's
//! automatic cleanup), which races with another writer creating an object in
//! the same directory: its directory can vanish between being made and the
//! object's file being created in it. A write that fails for a missing
//! directory is therefore tried again ([`WRITE_TRIES`] times in all); it had
//! created nothing.

use std::ops::Range;
use std::time::Duration;

use bytes::Bytes;
use futures::stream::BoxStream;
use object_store::local::LocalFileSystem;
use object_store::path::Path;
use object_store::{
    CopyOptions, GetOptions, GetResult, ListResult, MultipartUpload, ObjectMeta, ObjectStore,
    PutMultipartOptions, PutOptions, PutPayload, PutResult, RenameOptions,
};

/// How often a write whose directory vanished under it is tried.
pub const WRITE_TRIES: usize = 16;

/// Whether `e` is a write that failed because a directory on the object's
/// path changed under it: missing (`ENOENT`: another writer's delete removed
/// it after this write had made it) or, while being made, reported as
/// existing and then gone again (`EEXIST` from making a directory). Only
/// the backend's generic errors qualify: a conditional create that finds
/// the object is `AlreadyExists`, and is not tried again.
fn directory_vanished(e: &object_store::Error) -> bool {
    let object_store::Error::Generic { source, .. } = e else {
        return false;
    };
    let mut src: Option<&(dyn std::error::Error + 'static)> = Some(source.as_ref());
    while let Some(s) = src {
        if s.downcast_ref::<std::io::Error>().is_some_and(|io| {
            matches!(
                io.kind(),
                std::io::ErrorKind::NotFound | std::io::ErrorKind::AlreadyExists
            )
        }) {
            return true;
        }
        src = s.source();
    }
    false
}

/// Runs the write `op` until it succeeds, fails for another reason than a
/// vanished directory ([`directory_vanished`]), or has run [`WRITE_TRIES`]
/// times.
async fn retry_vanished<T, F>(mut op: impl FnMut() -> F) -> object_store::Result<T>
where
    F: std::future::Future<Output = object_store::Result<T>>,
{
    let mut tries = 1;
    loop {
        match op().await {
            Err(e) if tries < WRITE_TRIES && directory_vanished(&e) => tries += 1,
            r => return r,
        }
    }
}

/// Longest an open (with its checks) of a `file://` object may take.
pub const LOCAL_OPEN_TIMEOUT: Duration = Duration::from_secs(60);

/// A key of a `file://` store that names something other than a regular
/// file (the store layer classifies it as corrupt bucket content).
#[derive(Debug)]
pub(crate) struct NotRegularFile {
    path: std::path::PathBuf,
    what: &'static str,
}

impl std::fmt::Display for NotRegularFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} is {}, not a regular file: a file:// bucket serves regular files only (remove \
             it, or restore the object from the publisher)",
            self.path.display(),
            self.what
        )
    }
}

impl std::error::Error for NotRegularFile {}

/// [`LocalFileSystem`] that reads regular files only, with bounded opens.
#[derive(Debug)]
pub(crate) struct RegularFiles {
    inner: LocalFileSystem,
    timeout: Duration,
}

impl std::fmt::Display for RegularFiles {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RegularFiles({})", self.inner)
    }
}

impl RegularFiles {
    pub(crate) fn new(inner: LocalFileSystem) -> RegularFiles {
        RegularFiles {
            inner,
            timeout: LOCAL_OPEN_TIMEOUT,
        }
    }

    /// Refuses a key that exists and is not a regular file (links
    /// followed); a missing key is left to the backend (not found).
    async fn check(&self, location: &Path) -> object_store::Result<()> {
        let path = self.inner.path_to_filesystem(location)?;
        let meta = match tokio::fs::metadata(&path).await {
            Ok(m) => m,
            Err(_) => return Ok(()),
        };
        // Directories are no objects: the backend answers "not found".
        if meta.is_file() || meta.is_dir() {
            return Ok(());
        }
        use std::os::unix::fs::FileTypeExt;
        let t = meta.file_type();
        let what = if t.is_fifo() {
            "a FIFO"
        } else if t.is_socket() {
            "a socket"
        } else if t.is_block_device() || t.is_char_device() {
            "a device"
        } else {
            "not a file"
        };
        Err(object_store::Error::Generic {
            store: "LocalFileSystem",
            source: Box::new(NotRegularFile { path, what }),
        })
    }

    /// `op` on `location`, checked first, both within the timeout.
    async fn bounded<T>(
        &self,
        location: &Path,
        op: impl std::future::Future<Output = object_store::Result<T>>,
    ) -> object_store::Result<T> {
        let checked = async {
            self.check(location).await?;
            op.await
        };
        match tokio::time::timeout(self.timeout, checked).await {
            Ok(r) => r,
            Err(_) => Err(object_store::Error::Generic {
                store: "LocalFileSystem",
                source: Box::new(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!(
                        "the file system did not open {location} within {} s",
                        self.timeout.as_secs()
                    ),
                )),
            }),
        }
    }
}

#[async_trait::async_trait]
impl ObjectStore for RegularFiles {
    async fn put_opts(
        &self,
        location: &Path,
        payload: PutPayload,
        opts: PutOptions,
    ) -> object_store::Result<PutResult> {
        retry_vanished(|| self.inner.put_opts(location, payload.clone(), opts.clone())).await
    }

    async fn put_multipart_opts(
        &self,
        location: &Path,
        opts: PutMultipartOptions,
    ) -> object_store::Result<Box<dyn MultipartUpload>> {
        retry_vanished(|| self.inner.put_multipart_opts(location, opts.clone())).await
    }

    async fn get_opts(
        &self,
        location: &Path,
        options: GetOptions,
    ) -> object_store::Result<GetResult> {
        self.bounded(location, self.inner.get_opts(location, options))
            .await
    }

    async fn get_ranges(
        &self,
        location: &Path,
        ranges: &[Range<u64>],
    ) -> object_store::Result<Vec<Bytes>> {
        self.bounded(location, self.inner.get_ranges(location, ranges))
            .await
    }

    fn delete_stream(
        &self,
        locations: BoxStream<'static, object_store::Result<Path>>,
    ) -> BoxStream<'static, object_store::Result<Path>> {
        self.inner.delete_stream(locations)
    }

    fn list(&self, prefix: Option<&Path>) -> BoxStream<'static, object_store::Result<ObjectMeta>> {
        self.inner.list(prefix)
    }

    fn list_with_offset(
        &self,
        prefix: Option<&Path>,
        offset: &Path,
    ) -> BoxStream<'static, object_store::Result<ObjectMeta>> {
        self.inner.list_with_offset(prefix, offset)
    }

    async fn list_with_delimiter(&self, prefix: Option<&Path>) -> object_store::Result<ListResult> {
        self.inner.list_with_delimiter(prefix).await
    }

    async fn copy_opts(
        &self,
        from: &Path,
        to: &Path,
        options: CopyOptions,
    ) -> object_store::Result<()> {
        self.inner.copy_opts(from, to, options).await
    }

    async fn rename_opts(
        &self,
        from: &Path,
        to: &Path,
        options: RenameOptions,
    ) -> object_store::Result<()> {
        self.inner.rename_opts(from, to, options).await
    }
}

#[cfg(test)]
mod tests {
    use crate::store::Store;

    /// A `file://` store over a new temporary directory.
    fn temp_store() -> (tempfile::TempDir, Store) {
        let dir = tempfile::tempdir().unwrap();
        let url = url::Url::from_directory_path(dir.path())
            .unwrap()
            .to_string();
        let store = Store::open(&url).unwrap();
        (dir, store)
    }

    #[tokio::test]
    async fn only_regular_files_are_read_and_the_refusal_names_the_key() {
        let (dir, store) = temp_store();
        store
            .put("deltas/a", Bytes::from_static(b"fine"))
            .await
            .unwrap();
        let fifo = dir.path().join("fifo");
        let made = std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .unwrap();
        assert!(made.success(), "mkfifo");
        std::fs::create_dir_all(dir.path().join("deltas")).unwrap();
        std::os::unix::fs::symlink(&fifo, dir.path().join("deltas/b")).unwrap();
        std::os::unix::fs::symlink(dir.path().join("deltas/a"), dir.path().join("deltas/c"))
            .unwrap();
        assert_eq!(store.get("deltas/a").await.unwrap().unwrap(), "fine");
        // A link to a regular file is one.
        assert_eq!(store.get("deltas/c").await.unwrap().unwrap(), "fine");
        for e in [
            store.get("deltas/b").await.unwrap_err(),
            store.head("deltas/b").await.unwrap_err(),
            store.get_range("deltas/b", 0..4).await.unwrap_err(),
        ] {
            let text = e.to_string();
            assert!(text.contains("not a regular file"), "{text}");
            assert!(text.contains("deltas"), "{text}");
            assert_eq!(e.kind(), crate::error::ErrorKind::Corrupt, "{text}");
        }
        assert_eq!(store.get("deltas/none").await.unwrap(), None);
        assert_eq!(store.get("deltas").await.unwrap(), None, "a directory");
    }

    /// Two writers in one directory of a `file://` bucket, one deleting
    /// its object as the other creates one: the delete's cleanup removes
    /// the directory it left empty, and the other's write must not fail for
    /// it (as a create did when two ranks probed a new bucket at once).
    /// Plain puts, conditional creates and multipart uploads each race it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_directory_emptied_by_another_writer_does_not_fail_a_write() {
        let (dir, store) = temp_store();
        let files = super::RegularFiles::new(
            object_store::local::LocalFileSystem::new_with_prefix(dir.path())
                .unwrap()
                .with_automatic_cleanup(true),
        );
        let churn = {
            let store = store.clone();
            tokio::spawn(async move {
                for i in 0..3000 {
                    let key = format!("d/e/churn-{i}");
                    store.put(&key, Bytes::from_static(b"x")).await.unwrap();
                    store.delete(&key).await.unwrap();
                }
            })
        };
        let mut n = 0;
        while !churn.is_finished() {
            let key = format!("d/e/w-{n}");
            match n % 3 {
                0 => store.put(&key, Bytes::from_static(b"y")).await.unwrap(),
                1 => {
                    store.create(&key, Bytes::from_static(b"y")).await.unwrap();
                }
                _ => {
                    // The backend's own multipart upload (the store takes it
                    // for large objects only).
                    use object_store::ObjectStore;
                    let path = object_store::path::Path::from(key.as_str());
                    let mut up = files
                        .put_multipart_opts(&path, Default::default())
                        .await
                        .unwrap();
                    up.put_part(object_store::PutPayload::from_static(b"y"))
                        .await
                        .unwrap();
                    up.complete().await.unwrap();
                }
            }
            store.delete(&key).await.unwrap();
            n += 1;
        }
        churn.await.unwrap();
        assert!(n > 100, "only {n} writes raced the churn");
    }

    use bytes::Bytes;
}
