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

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::TryStreamExt;
use object_store::path::Path;
use object_store::{
    GetOptions, ObjectStore, ObjectStoreExt, PutMode, PutPayload, RetryConfig, WriteMultipart,
    local::LocalFileSystem, memory::InMemory, prefix::PrefixStore,
};

use crate::error::{Error, ErrorKind, Result};

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

/// Bytes read from a file per step of an upload.
const READ_STEP: u64 = 8 << 20;

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

/// The Hugging Face Storage Buckets S3 gateway.
pub const HF_S3_ENDPOINT: &str = "https://s3.hf.co";

/// Observer of transfer progress (the CLI draws progress bars with it): a
/// store reports its uploads to one ([`Store::with_progress`]) and the
/// subscriber's object downloads to another ([`Store::with_download_progress`]).
pub trait Progress: Send + Sync + std::fmt::Debug {
    /// A transfer of `bytes` bytes of `key` begins.
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
}

/// Splits `hf://buckets/<namespace>/<bucket>[/prefix]` into its S3 endpoint
/// path segment (the namespace), bucket and prefix.
fn parse_hf(parsed: &url::Url, url: &str) -> Result<(String, String, String)> {
    let bad = || {
        Error::Config(format!(
            "store URL `{url}`: expected hf://buckets/<namespace>/<bucket>[/prefix]"
        ))
    };
    if parsed.host_str() != Some("buckets") {
        return Err(bad());
    }
    let mut segs = parsed.path().trim_start_matches('/').splitn(3, '/');
    let namespace = segs.next().filter(|s| !s.is_empty()).ok_or_else(bad)?;
    let bucket = segs.next().filter(|s| !s.is_empty()).ok_or_else(bad)?;
    let prefix = segs.next().unwrap_or("");
    Ok((
        namespace.to_string(),
        bucket.to_string(),
        prefix.to_string(),
    ))
}

/// Where the Hugging Face tools keep a Hub token: `HF_TOKEN` (or the legacy
/// `HUGGING_FACE_HUB_TOKEN`), else the file `HF_TOKEN_PATH`, else
/// `$HF_HOME/token` (default `~/.cache/huggingface/token`). Returns where one
/// was found, for messages.
fn hf_token_source(env: &dyn Fn(&str) -> Option<String>) -> Option<String> {
    for var in ["HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"] {
        if env(var).is_some() {
            return Some(var.to_string());
        }
    }
    let file = env("HF_TOKEN_PATH")
        .map(std::path::PathBuf::from)
        .or_else(|| {
            env("HF_HOME")
                .map(std::path::PathBuf::from)
                .or_else(|| {
                    env("HOME").map(|h| std::path::Path::new(&h).join(".cache/huggingface"))
                })
                .map(|d| d.join("token"))
        })?;
    std::fs::metadata(&file)
        .ok()
        .filter(|m| m.is_file() && m.len() > 0)
        .map(|_| file.display().to_string())
}

/// The credentials of an `hf://` store: the `HF_S3_*` pair, else whatever
/// the `AWS_*` variables or explicit options give (`None`: the builder takes
/// them). With none at all the store is refused here, before any request —
/// object_store would otherwise ask the cloud metadata address and fail
/// minutes later with a message about it. The S3 gateway takes S3 keys
/// generated from a Hub token, not the token itself: a token that is present
/// is named in the message so the fix is obvious.
fn hf_credentials(
    url: &str,
    env: &dyn Fn(&str) -> Option<String>,
    options: &[(&str, &str)],
) -> Result<Option<(String, String)>> {
    if let (Some(id), Some(secret)) = (env("HF_S3_ACCESS_KEY_ID"), env("HF_S3_SECRET_ACCESS_KEY")) {
        return Ok(Some((id, secret)));
    }
    let option = |names: &[&str]| {
        options
            .iter()
            .any(|(k, v)| names.contains(&k.to_ascii_lowercase().as_str()) && !v.is_empty())
    };
    let keys = (env("AWS_ACCESS_KEY_ID").is_some()
        || option(&["aws_access_key_id", "access_key_id"]))
        && (env("AWS_SECRET_ACCESS_KEY").is_some()
            || option(&["aws_secret_access_key", "secret_access_key"]));
    let anonymous = env("AWS_SKIP_SIGNATURE").is_some_and(|v| v == "true")
        || options.iter().any(|(k, v)| {
            matches!(
                k.to_ascii_lowercase().as_str(),
                "aws_skip_signature" | "skip_signature"
            ) && *v == "true"
        });
    if keys || anonymous {
        return Ok(None);
    }
    let token = match hf_token_source(env) {
        Some(at) => format!(
            " A Hub token was found ({at}), but the S3 gateway does not take Hub tokens: \
             generate S3 credentials from it (huggingface.co, Settings → Access Tokens → \
             S3 credentials)."
        ),
        None => String::new(),
    };
    Err(Error::Config(format!(
        "store URL `{url}`: no credentials for the Hugging Face S3 gateway: set \
         HF_S3_ACCESS_KEY_ID and HF_S3_SECRET_ACCESS_KEY (or the AWS_* pair), or \
         AWS_SKIP_SIGNATURE=true to read a public bucket anonymously.{token}"
    )))
}

/// Makes `ring` the process's TLS crypto provider (rustls needs one chosen
/// when more than none is compiled in; weightcast builds only `ring`). An
/// application that installed its own first keeps it.
pub fn install_crypto_provider() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let _ = rustls::crypto::ring::default_provider().install_default();
    });
}

/// What the caller should do about a backend error.
fn store_kind(e: &object_store::Error) -> ErrorKind {
    use object_store::Error as E;
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
        _ => ErrorKind::Unavailable,
    }
}

/// What to tell an operator about a store failure, beyond the backend's own
/// words: the setting that most likely fixes it.
fn store_hint(url: &str, e: &object_store::Error) -> String {
    use object_store::Error as E;
    // The backend's message and every cause under it (reqwest keeps the
    // telling part, e.g. "URL scheme is not allowed", in a source).
    let mut text = e.to_string();
    let mut cause = std::error::Error::source(e);
    while let Some(c) = cause {
        text.push_str(": ");
        text.push_str(&c.to_string());
        cause = c.source();
    }
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
        _ if text.contains("NoSuchBucket") || text.contains("bucket does not exist") => {
            "the bucket does not exist: create it, or fix the bucket name in the store URL"
                .to_string()
        }
        _ => return String::new(),
    };
    format!(" ({hint})")
}

/// Client settings for multi-GB objects, applied after the environment and
/// before the caller's options: per-request timeout 300 s (object_store's
/// default of 30 s is too short for a 16 MiB part on a slow link), connect
/// timeout 10 s.
const CLIENT_DEFAULTS: [(&str, &str); 2] = [("timeout", "300s"), ("connect_timeout", "10s")];

/// Longest a failing request is retried, from its first attempt (see
/// `retry_config`).
pub const RETRY_BUDGET: Duration = Duration::from_secs(240);

/// Retries, bounded by time: a request that fails with a 5xx, 429 or 408, a
/// refused or reset connection, or (reads and other idempotent requests
/// only) a timeout, is retried with exponential backoff and jitter for up to
/// [`RETRY_BUDGET`] from its first attempt.
///
/// object_store bounds retries by count *and* by time, whichever comes
/// first, and its backoff draws each wait at random between the initial
/// wait and `base` × the previous one, capped: with its defaults (100 ms,
/// base 2, 10 retries) the waits grow by about 5% a step and a request gives
/// up after 1.7–8 s, whatever the time budget (measured through the fault
/// proxy, docs/operations.md). Here the count is no limit (1000) and base 3
/// makes the waits reach the 15 s cap within about ten retries, so an outage
/// of up to four minutes is ridden out with about 25 attempts. Four minutes
/// stays below the five-minute bound object_store advises: a retried request
/// keeps its original signature.
fn retry_config() -> RetryConfig {
    RetryConfig {
        backoff: object_store::BackoffConfig {
            init_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(15),
            base: 3.0,
        },
        max_retries: 1000,
        retry_timeout: RETRY_BUDGET,
    }
}

/// Applies `CLIENT_DEFAULTS` then `options` to a builder through its
/// string-keyed configuration.
fn configure<B, K>(
    mut builder: B,
    url: &str,
    options: &[(&str, &str)],
    with: impl Fn(B, K, &str) -> B,
) -> Result<B>
where
    K: std::str::FromStr,
    K::Err: std::fmt::Display,
{
    for (k, v) in CLIENT_DEFAULTS.iter().chain(options) {
        let key: K = k
            .parse()
            .map_err(|e| Error::Config(format!("store `{url}`: option `{k}`: {e}")))?;
        builder = with(builder, key, v);
    }
    Ok(builder)
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

    /// Opens a store by URL, taking credentials and endpoints from the
    /// conventional environment variables (see the module documentation).
    pub fn open(url: &str) -> Result<Store> {
        Self::open_with(url, &[])
    }

    /// [`Store::open`] with explicit options that override the environment,
    /// named as object_store's configuration keys (`aws_endpoint`,
    /// `aws_allow_http`, `google_base_url`, `azure_storage_account_name`, …),
    /// plus `hf_endpoint` for `hf://` stores (the gateway, without the namespace).
    pub fn open_with(url: &str, options: &[(&str, &str)]) -> Result<Store> {
        install_crypto_provider();
        let parsed =
            url::Url::parse(url).map_err(|e| Error::Config(format!("store URL `{url}`: {e}")))?;
        let bad = |e: object_store::Error| Error::Config(format!("store URL `{url}`: {e}"));
        if matches!(parsed.scheme(), "file" | "memory")
            && let Some((k, _)) = options.first()
        {
            return Err(Error::Config(format!(
                "store URL `{url}`: a {} store takes no options (given `{k}`); options \
                 configure s3, gs, az, http and hf stores",
                parsed.scheme()
            )));
        }
        let (base, prefix): (Arc<dyn ObjectStore>, String) = match parsed.scheme() {
            "file" => {
                let dir = parsed.to_file_path().map_err(|_| {
                    Error::Config(format!("store URL `{url}`: not an absolute path"))
                })?;
                std::fs::create_dir_all(&dir)
                    .map_err(|e| Error::io(format!("creating {}", dir.display()), e))?;
                (
                    Arc::new(LocalFileSystem::new_with_prefix(&dir).map_err(bad)?),
                    String::new(),
                )
            }
            "memory" => (Arc::new(InMemory::new()), parsed.path().to_string()),
            "s3" | "s3a" => {
                use object_store::aws::AmazonS3Builder as B;
                let b = configure(B::from_env().with_url(url), url, options, |b, k, v| {
                    b.with_config(k, v)
                })?;
                (
                    Arc::new(b.with_retry(retry_config()).build().map_err(bad)?),
                    parsed.path().to_string(),
                )
            }
            "hf" => {
                use object_store::aws::{AmazonS3Builder as B, AmazonS3ConfigKey as K};
                let (namespace, bucket, prefix) = parse_hf(&parsed, url)?;
                let env = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
                let endpoint = options
                    .iter()
                    .find(|(k, _)| *k == "hf_endpoint")
                    .map(|(_, v)| v.to_string())
                    .or_else(|| env("HF_S3_ENDPOINT"))
                    .unwrap_or_else(|| HF_S3_ENDPOINT.into());
                let options: Vec<(&str, &str)> = options
                    .iter()
                    .copied()
                    .filter(|(k, _)| *k != "hf_endpoint")
                    .collect();
                let mut b = B::from_env()
                    .with_bucket_name(bucket)
                    .with_endpoint(format!("{}/{namespace}", endpoint.trim_end_matches('/')))
                    .with_virtual_hosted_style_request(false)
                    .with_region("us-east-1");
                if let Some((id, secret)) = hf_credentials(url, &env, &options)? {
                    b = b.with_access_key_id(id).with_secret_access_key(secret);
                }
                if endpoint.starts_with("http://") {
                    b = b.with_config(K::Client(object_store::ClientConfigKey::AllowHttp), "true");
                }
                let b = configure(b, url, &options, |b, k, v| b.with_config(k, v))?;
                (
                    Arc::new(b.with_retry(retry_config()).build().map_err(bad)?),
                    prefix,
                )
            }
            "gs" => {
                use object_store::gcp::GoogleCloudStorageBuilder as B;
                let b = configure(B::from_env().with_url(url), url, options, |b, k, v| {
                    b.with_config(k, v)
                })?;
                (
                    Arc::new(b.with_retry(retry_config()).build().map_err(bad)?),
                    parsed.path().to_string(),
                )
            }
            "az" | "azure" | "abfs" | "abfss" | "adl" => {
                use object_store::azure::MicrosoftAzureBuilder as B;
                let b = configure(B::from_env().with_url(url), url, options, |b, k, v| {
                    b.with_config(k, v)
                })?;
                (
                    Arc::new(b.with_retry(retry_config()).build().map_err(bad)?),
                    parsed.path().to_string(),
                )
            }
            "http" | "https" => {
                use object_store::http::HttpBuilder as B;
                let b = configure(B::new().with_url(url), url, options, |b, k, v| {
                    b.with_config(k, v)
                })?;
                (
                    Arc::new(b.with_retry(retry_config()).build().map_err(bad)?),
                    String::new(),
                )
            }
            other => {
                return Err(Error::Config(format!(
                    "store URL `{url}`: unknown scheme `{other}` (expected file, memory, s3, gs, az, http(s) or hf)"
                )));
            }
        };
        let prefix = prefix.trim_matches('/');
        let inner: Arc<dyn ObjectStore> = if prefix.is_empty() {
            base
        } else {
            let p = Path::parse(prefix)
                .map_err(|e| Error::Config(format!("store URL `{url}`: {e}")))?;
            Arc::new(PrefixStore::new(base, p))
        };
        Ok(Store {
            inner,
            url: url.to_string(),
            progress: None,
            download: None,
        })
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

    /// Starts a multipart upload to `path` (`key`) in [`PART_SIZE`] parts.
    async fn multipart(&self, path: &Path, key: &str) -> Result<WriteMultipart> {
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
                hash_piece(&mut hasher, &chunk);
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

    /// Downloads the first `size` bytes of an object as concurrent ranged
    /// GETs of `part` bytes, at most `concurrency` in flight, handing the
    /// bytes to `sink(offset, bytes)` as they arrive — in pieces, in any
    /// order, each byte of `0..size` exactly once — typically a write at
    /// that offset in a file. Each part is streamed, not buffered: memory
    /// stays at a few network chunks (or a 1 MiB read buffer for local
    /// files) per part in flight, whatever the object's size. Returns the
    /// number of requests made. The caller checks what it assembled (size,
    /// BLAKE3); an object shorter than `size` is an error naming the key.
    pub async fn download_ranges<F>(
        &self,
        key: &str,
        size: u64,
        part: u64,
        concurrency: usize,
        sink: F,
    ) -> Result<u64>
    where
        F: Fn(u64, &[u8]) -> Result<()> + Sync,
    {
        use futures::StreamExt;
        let path = Self::path(key)?;
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
        let mut fetched = futures::stream::iter(0..parts)
            .map(|i| {
                let start = i * part;
                let end = (start + part).min(size);
                self.stream_range(key, path, start..end, sink)
            })
            .buffer_unordered(concurrency.max(1));
        while let Some(r) = fetched.next().await {
            r?;
        }
        Ok(parts)
    }

    /// [`Store::download_ranges`] into `file`, each byte written at its offset.
    pub async fn download_to(
        &self,
        key: &str,
        size: u64,
        file: &std::fs::File,
        part: u64,
        concurrency: usize,
    ) -> Result<u64> {
        use std::os::unix::fs::FileExt;
        self.download_ranges(key, size, part, concurrency, |at, b| {
            file.write_all_at(b, at)
                .map_err(|e| Error::io(format!("writing object {key} at offset {at}"), e))
        })
        .await
    }

    /// One ranged GET, streamed into `sink`.
    async fn stream_range<F>(
        &self,
        key: &str,
        path: &Path,
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
            hash_piece(&mut hasher, &b?);
        }
        Ok(Some((size, hasher.finalize().to_hex().to_string())))
    }

    /// Copies object `key` of this store to the same key of `to`, checking
    /// its size and BLAKE3 against `expected` as the bytes pass: the copy
    /// becomes visible only when both matched (a mismatch is an
    /// [`Error::Integrity`] naming the object, and a multipart upload is
    /// aborted, so nothing is left under the key). Small objects are read
    /// whole (below [`MULTIPART_THRESHOLD`]); larger ones stream through as
    /// ranged reads, `ahead` parts of [`PART_SIZE`] read ahead and as many
    /// uploading: memory is about 2 × `ahead` × [`PART_SIZE`] per copy,
    /// whatever the object's size.
    pub async fn copy_verified(
        &self,
        to: &Store,
        key: &str,
        expected: (u64, &str),
        ahead: usize,
    ) -> Result<()> {
        use futures::StreamExt;
        let (size, blake3) = expected;
        let mismatch = |expected: String, actual: String| Error::Integrity {
            scope: format!("object {key} at `{}` (not copied)", self.url),
            expected,
            actual,
        };
        let missing = || Error::NotFound(format!("object `{key}` is missing from `{}`", self.url));
        let found = self.head(key).await?.ok_or_else(missing)?;
        if found != size {
            return Err(mismatch(format!("{size} bytes"), format!("{found} bytes")));
        }
        let mut hasher = blake3::Hasher::new();
        if size < MULTIPART_THRESHOLD as u64 {
            let bytes = self.get_at_most(key, size).await?.ok_or_else(missing)?;
            if bytes.len() as u64 != size {
                return Err(mismatch(
                    format!("{size} bytes"),
                    format!("{} bytes", bytes.len()),
                ));
            }
            hash_piece(&mut hasher, &bytes);
            let got = hasher.finalize().to_hex();
            if got.as_str() != blake3 {
                return Err(mismatch(
                    format!("BLAKE3 {blake3}"),
                    format!("BLAKE3 {got}"),
                ));
            }
            return to.put(key, bytes).await;
        }
        let mut writer = to.multipart(&Self::path(key)?, key).await?;
        let mut parts = std::pin::pin!(self.read_parts(key, size, ahead));
        while let Some(piece) = parts.next().await {
            let piece = match piece {
                Ok(p) => p,
                Err(e) => {
                    writer.abort().await.ok();
                    return Err(e);
                }
            };
            hash_piece(&mut hasher, &piece);
            if let Err(e) = writer.wait_for_capacity(ahead.max(1)).await {
                writer.abort().await.ok();
                return Err(to.err("upload part", key, e));
            }
            writer.put(piece);
        }
        let got = hasher.finalize().to_hex();
        if got.as_str() != blake3 {
            writer.abort().await.ok();
            return Err(mismatch(
                format!("BLAKE3 {blake3}"),
                format!("BLAKE3 {got}"),
            ));
        }
        writer
            .finish()
            .await
            .map_err(|e| to.err("complete multipart upload", key, e))?;
        Ok(())
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

/// Feeds `piece` to `hasher`, on every core when it is large.
fn hash_piece(hasher: &mut blake3::Hasher, piece: &[u8]) {
    if piece.len() >= 1 << 20 {
        hasher.update_rayon(piece);
    } else {
        hasher.update(piece);
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
    use super::*;

    fn env_of(vars: &'static [(&'static str, &'static str)]) -> impl Fn(&str) -> Option<String> {
        move |k: &str| {
            vars.iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        }
    }

    #[test]
    fn hf_credentials_follow_the_conventions() {
        let url = "hf://buckets/ns/b";
        let got = hf_credentials(
            url,
            &env_of(&[
                ("HF_S3_ACCESS_KEY_ID", "HFAK1"),
                ("HF_S3_SECRET_ACCESS_KEY", "s"),
            ]),
            &[],
        )
        .unwrap();
        assert_eq!(got, Some(("HFAK1".into(), "s".into())));
        // The AWS pair or explicit options: the builder takes them.
        let aws = env_of(&[("AWS_ACCESS_KEY_ID", "a"), ("AWS_SECRET_ACCESS_KEY", "b")]);
        assert_eq!(hf_credentials(url, &aws, &[]).unwrap(), None);
        let opts = [("aws_access_key_id", "a"), ("aws_secret_access_key", "b")];
        assert_eq!(hf_credentials(url, &env_of(&[]), &opts).unwrap(), None);
        let anon = [("aws_skip_signature", "true")];
        assert_eq!(hf_credentials(url, &env_of(&[]), &anon).unwrap(), None);
        // Nothing: refused before any request, naming the settings.
        let e = hf_credentials(url, &env_of(&[("HOME", "/nonexistent")]), &[])
            .unwrap_err()
            .to_string();
        assert!(e.contains(url) && e.contains("HF_S3_ACCESS_KEY_ID"), "{e}");
        assert!(!e.contains("Hub token was found"), "{e}");
        // A Hub token (variable or token file) is named: it is not enough.
        let e = hf_credentials(url, &env_of(&[("HF_TOKEN", "hf_x")]), &[])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("HF_TOKEN") && e.contains("S3 credentials"),
            "{e}"
        );
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("token"), "hf_y").unwrap();
        let home = dir.path().to_str().unwrap().to_string();
        let env = move |k: &str| (k == "HF_HOME").then(|| home.clone());
        let e = hf_credentials(url, &env, &[]).unwrap_err().to_string();
        assert!(
            e.contains(&format!("{}", dir.path().join("token").display())),
            "{e}"
        );
        assert_eq!(
            Error::Config(String::new()).kind(),
            crate::error::ErrorKind::Config
        );
    }
    use futures::stream::BoxStream;
    use object_store::{
        CopyOptions, GetResult, ListResult, MultipartUpload, ObjectMeta, PutMultipartOptions,
        PutOptions, PutResult,
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
    async fn copy_verified_streams_large_objects_and_refuses_mismatches() {
        let (from, to) = (
            Store::open("memory://").unwrap(),
            Store::open("memory://").unwrap(),
        );
        // Above the multipart threshold, not a whole number of parts.
        let len = MULTIPART_THRESHOLD + PART_SIZE + 12345;
        let body: Vec<u8> = (0..len).map(|i| (i * 31 % 251) as u8).collect();
        let hash = blake3::hash(&body).to_hex().to_string();
        from.put("anchors/a", Bytes::from(body.clone()))
            .await
            .unwrap();
        from.put("deltas/d", Bytes::from_static(b"small"))
            .await
            .unwrap();
        let small = blake3::hash(b"small").to_hex().to_string();

        // A wrong hash or size: an Integrity error naming the object, and
        // nothing at the destination (the multipart upload was aborted).
        let wrong = blake3::hash(b"other").to_hex().to_string();
        for (key, size, h) in [
            ("anchors/a", len as u64, wrong.as_str()),
            ("anchors/a", len as u64 - 1, hash.as_str()),
            ("deltas/d", 5, wrong.as_str()),
        ] {
            let e = from
                .copy_verified(&to, key, (size, h), 2)
                .await
                .unwrap_err();
            assert!(
                matches!(&e, Error::Integrity { scope, .. } if scope.contains(key)),
                "{e}"
            );
            assert_eq!(to.head(key).await.unwrap(), None, "{key} left behind");
        }
        let e = from
            .copy_verified(&to, "deltas/none", (5, &small), 2)
            .await
            .unwrap_err();
        assert!(matches!(e, Error::NotFound(_)), "{e}");

        from.copy_verified(&to, "anchors/a", (len as u64, &hash), 2)
            .await
            .unwrap();
        from.copy_verified(&to, "deltas/d", (5, &small), 2)
            .await
            .unwrap();
        assert_eq!(to.get("anchors/a").await.unwrap().unwrap(), body);
        assert_eq!(
            to.measure("anchors/a").await.unwrap(),
            Some((len as u64, hash))
        );
        assert_eq!(to.measure("deltas/d").await.unwrap(), Some((5, small)));
        assert_eq!(to.measure("nothing").await.unwrap(), None);
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
