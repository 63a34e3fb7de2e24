//! The bucket: any object store `object_store` reaches, opened by URL, with the
//! few operations the bucket protocol needs — plain and conditional puts (large
//! objects in multipart), reads that can be conditional on an ETag, listing —
//! and a probe for stores that silently ignore conditional writes.
//!
//! | URL | backend | configuration |
//! |---|---|---|
//! | `file:///abs/dir` | local filesystem | – |
//! | `memory://` | in-process (tests, demos) | – |
//! | `s3://bucket/prefix` | AWS S3 and S3-compatible (MinIO, R2, Ceph, Garage, moto) | `AWS_*` variables (`AWS_ENDPOINT`, `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_REGION`, `AWS_ALLOW_HTTP`, …) |
//! | `gs://bucket/prefix` | Google Cloud Storage | `GOOGLE_*` variables (`GOOGLE_SERVICE_ACCOUNT`, `GOOGLE_BASE_URL`, …) |
//! | `az://container/prefix` | Azure Blob Storage | `AZURE_*` variables |
//! | `http(s)://host/path` | WebDAV-style HTTP | – |
//! | `hf://buckets/<namespace>/<bucket>/prefix` | Hugging Face Storage Buckets through their S3 gateway | `HF_S3_ACCESS_KEY_ID` / `HF_S3_SECRET_ACCESS_KEY` (or the `AWS_*` pair); `HF_S3_ENDPOINT` overrides `https://s3.hf.co` |
//!
//! The `hf://` preset is an S3 store with the endpoint
//! `https://s3.hf.co/<namespace>`, path-style addressing and region
//! `us-east-1`, as the gateway expects; its keys (`HFAK…`) are generated from a
//! Hugging Face access token (Settings → Access Tokens → Generate S3
//! credentials). Explicit options (`aws_*` keys) still override it.
//!
//! Keys are relative to the URL's path; a [`Store`] never reads or writes
//! outside it.
//!
//! Modules: `open` (URLs, backends, options, credentials, retries),
//! `read` (reads, conditional and bounded; ranged downloads; listings),
//! `write` (puts, multipart uploads, conditional creates, the probe),
//! `growing` (uploads that overlap the writing of their data), `copy`
//! (verified copies between stores).

mod contact;
mod copy;
mod growing;
mod local;
mod open;
mod read;
mod write;

use std::sync::Arc;

use bytes::Bytes;
use object_store::ObjectStore;
use object_store::multipart::MultipartStore;
use object_store::path::Path;

use crate::error::{Error, ErrorKind, Result};

pub use contact::FIRST_CONTACT_TIMEOUT;
pub use growing::{Growing, GrowingWriter, growing};
pub use local::LOCAL_OPEN_TIMEOUT;
pub use open::{HF_S3_ENDPOINT, RETRY_BUDGET, install_crypto_provider};

/// Objects at least this large are uploaded in parts.
pub const MULTIPART_THRESHOLD: usize = 64 << 20;

/// Size of one multipart part (equal sizes suit every store, R2 included).
pub const PART_SIZE: usize = 16 << 20;

/// Parts uploaded concurrently.
pub const PART_CONCURRENCY: usize = 8;

/// A piece of an object being uploaded (see [`Store::put_sources`]).
#[derive(Clone, Debug)]
pub enum Source {
    /// Bytes in memory.
    Bytes(Bytes),
    /// `len` bytes of a file from `offset`, read when their part is sent.
    File {
        /// The file.
        path: std::path::PathBuf,
        /// Where the bytes start.
        offset: u64,
        /// How many.
        len: u64,
    },
}

impl Source {
    /// Bytes this source contributes.
    pub fn len(&self) -> u64 {
        match self {
            Source::Bytes(b) => b.len() as u64,
            Source::File { len, .. } => *len,
        }
    }

    /// Whether it contributes nothing.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Outcome of a conditional create.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Created {
    /// The object did not exist and now holds our bytes.
    Created,
    /// An object was already there; nothing was written.
    AlreadyExists,
}

/// Whether a store enforces create-if-absent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConditionalWrites {
    /// A second create of the same key is refused.
    Enforced,
    /// A second create silently overwrote the first (e.g. Garage 2.5, fake-gcs-server).
    Ignored,
}

/// Result of a conditional read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Fetched {
    /// The object still has the ETag the caller knows.
    NotModified,
    /// No such object.
    Missing,
    /// The object's bytes and its ETag (when the store reports one).
    Body {
        /// Content.
        bytes: Bytes,
        /// Entity tag, to pass back on the next read.
        etag: Option<String>,
    },
}

/// One listed object.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Listed {
    /// Key relative to the store's prefix.
    pub key: String,
    /// Size in bytes.
    pub size: u64,
}

/// Observer of transfer progress (the CLI draws progress bars with it): a
/// store reports its uploads to one ([`Store::with_progress`]) and the
/// subscriber's object downloads to another ([`Store::with_download_progress`]).
pub trait Progress: Send + Sync + std::fmt::Debug {
    /// A transfer of `bytes` bytes of `key` begins (an object uploaded while
    /// it is written, [`Store::put_growing`], reports each part as it is
    /// queued: its total is not known in advance).
    fn started(&self, key: &str, bytes: u64);
    /// `bytes` more bytes were moved (a part, a network chunk, or a whole
    /// small object).
    fn advanced(&self, bytes: u64);
}

/// A bucket (and prefix) opened by URL.
#[derive(Clone, Debug)]
pub struct Store {
    inner: Arc<dyn ObjectStore>,
    url: String,
    progress: Option<Arc<dyn Progress>>,
    download: Option<Arc<dyn Progress>>,
    max_object_size: u64,
    /// What explains a silence at first contact (remote stores).
    contact: Option<Contact>,
    /// Multipart uploads with parts in any order, where the backend has them.
    parts: Option<Parts>,
}

/// The base store's multipart API, whose parts may be sent in any order, and
/// the URL's path under which keys live.
#[derive(Clone)]
pub(crate) struct Parts {
    pub(crate) store: Arc<dyn MultipartStore>,
    pub(crate) prefix: Option<Path>,
    /// Parts of growing uploads in flight or being read, shared by all the
    /// growing uploads through this store (and its clones): however many
    /// overlap, memory stays that of one upload ([`PART_CONCURRENCY`] parts
    /// of [`PART_SIZE`]).
    pub(crate) budget: Arc<tokio::sync::Semaphore>,
}

impl std::fmt::Debug for Parts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Parts")
            .field("prefix", &self.prefix)
            .finish_non_exhaustive()
    }
}

impl Parts {
    /// `path` under the URL's path.
    pub(crate) fn full(&self, path: &Path) -> Path {
        match &self.prefix {
            Some(p) => p.parts().chain(path.parts()).collect(),
            None => path.clone(),
        }
    }
}

/// What explains a silent store at first contact (`contact`): where requests
/// go, and where credentials come from when none are configured.
#[derive(Clone, Debug)]
pub(crate) struct Contact {
    /// The endpoint requests go to (a URL).
    pub endpoint: String,
    /// The setting that names the endpoint.
    pub endpoint_setting: &'static str,
    /// When no credentials are configured: the service the client asks for
    /// some (a metadata endpoint URL) and the settings that configure them.
    pub no_credentials: Option<(String, &'static str)>,
}

/// The largest object a reader accepts by default
/// ([`Store::with_max_object_size`]): 64 GiB, above any checkpoint shard
/// (Hugging Face writes 5–10 GB shards; a 30B-parameter model in one bf16
/// file is 60 GB).
pub const DEFAULT_MAX_OBJECT_SIZE: u64 = 64 << 30;

/// A backend error's message and every cause under it (reqwest keeps the
/// telling part, e.g. "URL scheme is not allowed", in a source).
fn chain_text(e: &object_store::Error) -> String {
    let mut text = e.to_string();
    let mut cause = std::error::Error::source(e);
    while let Some(c) = cause {
        text.push_str(": ");
        text.push_str(&c.to_string());
        cause = c.source();
    }
    text
}

/// Whether the store answered that the bucket (or container) does not exist.
fn missing_bucket(text: &str) -> bool {
    text.contains("NoSuchBucket")
        || text.contains("ContainerNotFound")
        || text.contains("bucket does not exist")
}

/// What the caller should do about a backend error. A missing bucket is
/// configuration whatever the request (a listing's 404 and a read's).
fn store_kind(e: &object_store::Error) -> ErrorKind {
    use object_store::Error as E;
    if missing_bucket(&chain_text(e)) {
        return ErrorKind::Config;
    }
    match e {
        E::NotFound { .. } => ErrorKind::NotFound,
        E::AlreadyExists { .. } | E::Precondition { .. } | E::NotModified { .. } => {
            ErrorKind::Precondition
        }
        E::PermissionDenied { .. }
        | E::Unauthenticated { .. }
        | E::UnknownConfigurationKey { .. }
        | E::NotSupported { .. }
        | E::NotImplemented { .. }
        | E::InvalidPath { .. } => ErrorKind::Config,
        // A file:// key that is a FIFO, device or socket: damaged bucket
        // content, like a corrupt object.
        E::Generic { source, .. } if source.is::<local::NotRegularFile>() => ErrorKind::Corrupt,
        _ => ErrorKind::Unavailable,
    }
}

/// What to tell an operator about a store failure, beyond the backend's own
/// words: the setting that most likely fixes it.
fn store_hint(url: &str, e: &object_store::Error) -> String {
    use object_store::Error as E;
    let text = chain_text(e);
    let scheme = url.split("://").next().unwrap_or("");
    let creds = match scheme {
        "s3" | "s3a" => {
            "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (and AWS_REGION, AWS_ENDPOINT for S3-compatible stores)"
        }
        "hf" => {
            "HF_S3_ACCESS_KEY_ID / HF_S3_SECRET_ACCESS_KEY (generate S3 credentials from a Hugging Face token)"
        }
        "gs" => "GOOGLE_SERVICE_ACCOUNT (or GOOGLE_APPLICATION_CREDENTIALS)",
        "az" | "azure" | "abfs" | "abfss" | "adl" => {
            "AZURE_STORAGE_ACCOUNT_NAME / AZURE_STORAGE_ACCOUNT_KEY"
        }
        _ => "the store's credentials",
    };
    let hint = match e {
        E::Unauthenticated { .. } | E::PermissionDenied { .. } => {
            format!("check the credentials: {creds}")
        }
        _ if text.contains("scheme is not allowed") => {
            "the endpoint is http://: set AWS_ALLOW_HTTP=true (or the store's allow_http option) \
             to allow unencrypted connections"
                .to_string()
        }
        _ if text.contains("169.254.169.254") || text.contains("instance metadata") => format!(
            "no credentials were found, so the client asked the cloud metadata service: set {creds}"
        ),
        _ if missing_bucket(&text) => {
            "the bucket does not exist: create it (docs/stores.md), or fix the bucket name in \
             the store URL"
                .to_string()
        }
        _ if text.contains("Connection refused") || text.contains("dns error") => format!(
            "the store's endpoint cannot be reached: check its address ({}) and the network",
            endpoint_setting(scheme)
        ),
        _ => return String::new(),
    };
    format!(" ({hint})")
}

/// The setting that names a store's endpoint, for messages.
fn endpoint_setting(scheme: &str) -> &'static str {
    match scheme {
        "s3" | "s3a" => "AWS_ENDPOINT, or the bucket's region AWS_REGION",
        "hf" => "HF_S3_ENDPOINT",
        "gs" => "GOOGLE_BASE_URL",
        "az" | "azure" | "abfs" | "abfss" | "adl" => "AZURE_STORAGE_ENDPOINT",
        _ => "the store URL",
    }
}

impl Store {
    /// The error for a failed store operation: names the operation, the key
    /// and the store, with a hint at the likely fix.
    pub(crate) fn err(&self, op: &str, key: &str, source: object_store::Error) -> Error {
        Error::Store {
            op: op.to_string(),
            key: key.to_string(),
            url: self.url.clone(),
            hint: store_hint(&self.url, &source),
            kind: store_kind(&source),
            source: Box::new(source),
        }
    }

    /// This store, reporting its uploads to `progress`.
    pub fn with_progress(mut self, progress: Arc<dyn Progress>) -> Store {
        self.progress = Some(progress);
        self
    }

    /// This store, reporting object downloads (the subscriber's verified
    /// object reads, not manifests or hints) to `progress`.
    pub fn with_download_progress(mut self, progress: Arc<dyn Progress>) -> Store {
        self.download = Some(progress);
        self
    }

    /// This store, refusing to read an object declared (by a manifest) or
    /// found larger than `bytes` ([`DEFAULT_MAX_OBJECT_SIZE`] otherwise):
    /// what a subscriber holds in memory or writes to disk for one object,
    /// and what a relay copies.
    pub fn with_max_object_size(mut self, bytes: u64) -> Store {
        self.max_object_size = bytes;
        self
    }

    /// The largest object this store's readers accept.
    pub fn max_object_size(&self) -> u64 {
        self.max_object_size
    }

    /// Where object downloads are reported, if anywhere.
    pub fn download_progress(&self) -> Option<&Arc<dyn Progress>> {
        self.download.as_ref()
    }

    /// Wraps an existing `object_store` backend (already scoped to its prefix).
    pub fn from_object_store(inner: Arc<dyn ObjectStore>, url: impl Into<String>) -> Store {
        Store {
            inner,
            url: url.into(),
            progress: None,
            download: None,
            max_object_size: DEFAULT_MAX_OBJECT_SIZE,
            contact: None,
            parts: None,
        }
    }

    /// The URL the store was opened with.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The underlying backend.
    pub fn inner(&self) -> &Arc<dyn ObjectStore> {
        &self.inner
    }

    fn path(key: &str) -> Result<Path> {
        // `Path::parse` rejects empty segments, `.` and `..`: a key can never
        // leave the store's prefix.
        Path::parse(key).map_err(|e| Error::Config(format!("invalid object key `{key}`: {e}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn store_errors_are_classified_by_their_cause() {
        let store = Store::open("memory://").unwrap();
        let e = |source| store.err("get", "k", source);
        let nf = object_store::Error::NotFound {
            path: "k".into(),
            source: "gone".into(),
        };
        assert_eq!(e(nf).kind(), ErrorKind::NotFound);
        let pre = object_store::Error::Precondition {
            path: "k".into(),
            source: "etag".into(),
        };
        assert_eq!(e(pre).kind(), ErrorKind::Precondition);
        let denied = object_store::Error::PermissionDenied {
            path: "k".into(),
            source: "403".into(),
        };
        assert_eq!(e(denied).kind(), ErrorKind::Config);
        let generic = object_store::Error::Generic {
            store: "S3",
            source: "connection reset".into(),
        };
        assert_eq!(e(generic).kind(), ErrorKind::Unavailable);
        assert!(
            e(object_store::Error::Generic {
                store: "S3",
                source: "x".into()
            })
            .kind()
            .is_retryable()
        );
    }
}
