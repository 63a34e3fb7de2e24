//! Opening a store: URL schemes, backend construction, client settings and
//! retries, explicit options over the environment, and the credentials of
//! `hf://` stores.

use std::sync::Arc;
use std::time::Duration;

use object_store::multipart::MultipartStore;
use object_store::path::Path;
use object_store::{
    ObjectStore, RetryConfig, local::LocalFileSystem, memory::InMemory, prefix::PrefixStore,
};

use super::Store;
use crate::error::{Error, Result};

/// The Hugging Face Storage Buckets S3 gateway.
pub const HF_S3_ENDPOINT: &str = "https://s3.hf.co";

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

/// The error for a store URL that does not parse, with the fix: a bare path
/// becomes the `file://` URL it most likely means.
fn bad_url(url: &str, e: url::ParseError) -> Error {
    let fix = if url.trim().is_empty() {
        "give a store URL: file:///ABS/DIR, s3://BUCKET/PREFIX, gs://, az://, hf://buckets/NS/B, \
         http(s)://, memory://"
            .to_string()
    } else if !url.contains("://") {
        let path = std::path::absolute(url).unwrap_or_else(|_| std::path::PathBuf::from(url));
        format!(
            "a store is a URL, not a path: for a local directory write file://{} (an absolute \
             path); else s3://BUCKET/PREFIX, gs://, az://, hf://buckets/NS/B, http(s)://",
            path.display()
        )
    } else {
        "expected file:///ABS/DIR, s3://BUCKET/PREFIX, gs://BUCKET/PREFIX, \
         az://CONTAINER/PREFIX, hf://buckets/NS/BUCKET, http(s)://HOST/PATH or memory://"
            .to_string()
    };
    Error::Config(format!("store URL `{url}` is not a URL ({e}): {fix}"))
}

impl Store {
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
        let parsed = url::Url::parse(url).map_err(|e| bad_url(url, e))?;
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
        if matches!(parsed.scheme(), "s3" | "s3a" | "gs" | "az" | "azure")
            && parsed.host_str().is_none_or(str::is_empty)
        {
            let s = parsed.scheme();
            let what = if matches!(s, "az" | "azure") {
                "container"
            } else {
                "bucket"
            };
            return Err(Error::Config(format!(
                "store URL `{url}` names no {what}: write {s}://{}/PREFIX, e.g. {s}://weights/policy \
                 (docs/stores.md creates one)",
                what.to_uppercase()
            )));
        }
        let mut contact = None;
        let ((base, parts), prefix): (BaseStore, String) = match parsed.scheme() {
            "file" => {
                let dir = parsed.to_file_path().map_err(|_| {
                    Error::Config(format!(
                        "store URL `{url}`: not an absolute path: write file:///ABS/DIR (three \
                         slashes, then the directory's absolute path)"
                    ))
                })?;
                std::fs::create_dir_all(&dir)
                    .map_err(|e| Error::io(format!("creating {}", dir.display()), e))?;
                (
                    // Deleting an object removes the directories it leaves
                    // empty (gc would otherwise leave the bucket's tree).
                    (
                        Arc::new(super::local::RegularFiles::new(
                            LocalFileSystem::new_with_prefix(&dir)
                                .map_err(bad)?
                                .with_automatic_cleanup(true),
                        )),
                        None,
                    ),
                    String::new(),
                )
            }
            "memory" => (with_parts(InMemory::new()), parsed.path().to_string()),
            "s3" | "s3a" => {
                use object_store::aws::AmazonS3Builder as B;
                let b = configure(B::from_env().with_url(url), url, options, |b, k, v| {
                    b.with_config(k, v)
                })?;
                contact = Some(super::Contact::s3(&b));
                (
                    with_parts(b.with_retry(retry_config()).build().map_err(bad)?),
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
                contact = Some(super::Contact::s3(&b));
                (
                    with_parts(b.with_retry(retry_config()).build().map_err(bad)?),
                    prefix,
                )
            }
            "gs" => {
                use object_store::gcp::GoogleCloudStorageBuilder as B;
                let b = configure(B::from_env().with_url(url), url, options, |b, k, v| {
                    b.with_config(k, v)
                })?;
                contact = Some(super::Contact::gcs(&b));
                (
                    with_parts(b.with_retry(retry_config()).build().map_err(bad)?),
                    parsed.path().to_string(),
                )
            }
            "az" | "azure" | "abfs" | "abfss" | "adl" => {
                use object_store::azure::MicrosoftAzureBuilder as B;
                let b = configure(B::from_env().with_url(url), url, options, |b, k, v| {
                    b.with_config(k, v)
                })?;
                contact = Some(super::Contact::azure(&b));
                (
                    with_parts(b.with_retry(retry_config()).build().map_err(bad)?),
                    parsed.path().to_string(),
                )
            }
            "http" | "https" => {
                use object_store::http::HttpBuilder as B;
                let b = configure(B::new().with_url(url), url, options, |b, k, v| {
                    b.with_config(k, v)
                })?;
                contact = Some(super::Contact::http(url));
                (
                    (
                        Arc::new(b.with_retry(retry_config()).build().map_err(bad)?),
                        None,
                    ),
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
        let prefix = if prefix.is_empty() {
            None
        } else {
            Some(
                Path::parse(prefix)
                    .map_err(|e| Error::Config(format!("store URL `{url}`: {e}")))?,
            )
        };
        let inner: Arc<dyn ObjectStore> = match &prefix {
            None => base,
            Some(p) => Arc::new(PrefixStore::new(base, p.clone())),
        };
        let parts = parts.map(|store| super::Parts {
            store,
            prefix,
            budget: Arc::new(tokio::sync::Semaphore::new(super::PART_CONCURRENCY)),
        });
        Ok(Store {
            inner,
            url: url.to_string(),
            progress: None,
            download: None,
            max_object_size: super::DEFAULT_MAX_OBJECT_SIZE,
            contact,
            parts,
        })
    }
}

/// A backend, and its multipart API when it takes parts in any order.
type BaseStore = (Arc<dyn ObjectStore>, Option<Arc<dyn MultipartStore>>);

fn with_parts<S: ObjectStore + MultipartStore>(store: S) -> BaseStore {
    let s = Arc::new(store);
    (s.clone(), Some(s))
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
}
