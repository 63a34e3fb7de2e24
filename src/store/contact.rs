//! The first contact with a store, bounded: a command checks at start that
//! its store answers ([`Store::check_contact`]), so that a store that is
//! unreachable or cannot authenticate fails the command within
//! [`FIRST_CONTACT_TIMEOUT`], naming the cause and the fix, instead of
//! retrying in silence for the whole retry budget (`RETRY_BUDGET`, minutes).
//!
//! Two silences are common and look alike from inside a request: a store
//! with no credentials configured, whose client asks the cloud's metadata
//! service for some (on a host where nothing answers there, every attempt
//! hangs until its timeout and is retried), and an endpoint that refuses or
//! drops connections (retried as transient). When the probe runs out of
//! time, the cause is told apart from what was configured and from a TCP
//! connection to the endpoint.

use std::time::Duration;

use object_store::{ObjectStore, ObjectStoreExt};

use super::{Contact, Store};
use crate::error::{Error, Result};

/// Longest the first contact with a store may take before a command fails.
pub const FIRST_CONTACT_TIMEOUT: Duration = Duration::from_secs(15);

/// The key an `http(s)://` store is probed with (the bucket's hint; the
/// store layer knows no layout, so it is named here).
const PROBE_KEY: &str = "latest.json";

/// Longest the TCP connection that diagnoses a silent endpoint may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);

impl Contact {
    /// An S3 store's, from its builder's settings (environment and options).
    pub fn s3(b: &object_store::aws::AmazonS3Builder) -> Contact {
        use object_store::aws::AmazonS3ConfigKey as K;
        let get = |k: K| b.get_config_value(&k).filter(|v| !v.is_empty());
        let region = get(K::Region).unwrap_or_else(|| "us-east-1".into());
        let endpoint = get(K::Endpoint).unwrap_or_else(|| {
            let bucket = get(K::Bucket).unwrap_or_default();
            format!("https://{bucket}.s3.{region}.amazonaws.com")
        });
        let configured = (get(K::AccessKeyId).is_some() && get(K::SecretAccessKey).is_some())
            || get(K::SkipSignature).is_some_and(|v| v == "true")
            || get(K::WebIdentityTokenFile).is_some()
            || get(K::ContainerCredentialsRelativeUri).is_some()
            || get(K::ContainerCredentialsFullUri).is_some();
        let metadata = get(K::MetadataEndpoint).unwrap_or_else(|| "http://169.254.169.254".into());
        Contact {
            endpoint,
            endpoint_setting: "AWS_ENDPOINT (and AWS_REGION)",
            no_credentials: (!configured).then_some((
                metadata,
                "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or an instance role, or \
                 AWS_SKIP_SIGNATURE=true for a public bucket)",
            )),
        }
    }

    /// A GCS store's.
    pub fn gcs(b: &object_store::gcp::GoogleCloudStorageBuilder) -> Contact {
        use object_store::gcp::GoogleConfigKey as K;
        let get = |k: K| b.get_config_value(&k).filter(|v| !v.is_empty());
        let adc = std::env::var_os("HOME").is_some_and(|h| {
            std::path::Path::new(&h)
                .join(".config/gcloud/application_default_credentials.json")
                .is_file()
        });
        let configured = get(K::ServiceAccount).is_some()
            || get(K::ServiceAccountKey).is_some()
            || get(K::ApplicationCredentials).is_some()
            || get(K::BearerToken).is_some()
            || get(K::SkipSignature).is_some_and(|v| v == "true")
            || std::env::var_os("GOOGLE_APPLICATION_CREDENTIALS").is_some()
            || adc;
        Contact {
            endpoint: get(K::BaseUrl).unwrap_or_else(|| "https://storage.googleapis.com".into()),
            endpoint_setting: "GOOGLE_BASE_URL",
            no_credentials: (!configured).then_some((
                "http://metadata.google.internal (the GCE metadata server)".into(),
                "GOOGLE_SERVICE_ACCOUNT (a key file) or GOOGLE_APPLICATION_CREDENTIALS",
            )),
        }
    }

    /// An Azure store's.
    pub fn azure(b: &object_store::azure::MicrosoftAzureBuilder) -> Contact {
        use object_store::azure::AzureConfigKey as K;
        let get = |k: K| b.get_config_value(&k).filter(|v| !v.is_empty());
        let configured = get(K::AccessKey).is_some()
            || get(K::SasKey).is_some()
            || get(K::Token).is_some()
            || get(K::ClientSecret).is_some()
            || get(K::FederatedTokenFile).is_some()
            || get(K::UseEmulator).is_some_and(|v| v == "true")
            || get(K::UseAzureCli).is_some_and(|v| v == "true")
            || get(K::SkipSignature).is_some_and(|v| v == "true");
        let account = get(K::AccountName).unwrap_or_else(|| "ACCOUNT".into());
        Contact {
            endpoint: get(K::Endpoint)
                .unwrap_or_else(|| format!("https://{account}.blob.core.windows.net")),
            endpoint_setting: "AZURE_STORAGE_ENDPOINT (or AZURE_STORAGE_ACCOUNT_NAME)",
            no_credentials: (!configured).then_some((
                get(K::MsiEndpoint).unwrap_or_else(|| {
                    "http://169.254.169.254 (the managed identity endpoint)".into()
                }),
                "AZURE_STORAGE_ACCOUNT_KEY (or AZURE_STORAGE_SAS_KEY, or a managed identity)",
            )),
        }
    }

    /// An `http(s)://` store's: the URL itself, no credentials.
    pub fn http(url: &str) -> Contact {
        Contact {
            endpoint: url.to_string(),
            endpoint_setting: "the store URL",
            no_credentials: None,
        }
    }
}

/// The `host:port` of an endpoint URL (the scheme's port by default).
fn host_port(endpoint: &str) -> Option<(String, u16)> {
    let u = url::Url::parse(endpoint.split_whitespace().next()?).ok()?;
    Some((u.host_str()?.to_string(), u.port_or_known_default()?))
}

/// What one TCP connection to `endpoint` says: `Ok(address)` when it
/// connected, else why not (with the address when it resolved).
async fn try_connect(endpoint: &str) -> std::result::Result<String, String> {
    let Some((host, port)) = host_port(endpoint) else {
        return Err("its address cannot be read from the URL".into());
    };
    let addrs: Vec<std::net::SocketAddr> = match tokio::time::timeout(
        CONNECT_TIMEOUT,
        tokio::net::lookup_host((host.as_str(), port)),
    )
    .await
    {
        Ok(Ok(a)) => a.collect(),
        Ok(Err(e)) => return Err(format!("the host name `{host}` does not resolve ({e})")),
        Err(_) => return Err(format!("the host name `{host}` did not resolve in time")),
    };
    let Some(addr) = addrs.first().copied() else {
        return Err(format!("the host name `{host}` resolves to no address"));
    };
    match tokio::time::timeout(CONNECT_TIMEOUT, tokio::net::TcpStream::connect(addr)).await {
        Ok(Ok(_)) => Ok(addr.to_string()),
        Ok(Err(e)) => Err(format!("address {addr}: {e}")),
        Err(_) => Err(format!(
            "address {addr}: no answer to a connection within {} s",
            CONNECT_TIMEOUT.as_secs()
        )),
    }
}

impl Store {
    /// Checks that the store answers: one listing of the prefix root (a HEAD
    /// for `http(s)://` stores), bounded by [`FIRST_CONTACT_TIMEOUT`]. A
    /// store that refuses at once (wrong credentials, a missing bucket) fails
    /// with the store's error and its hint; one that stays silent fails when
    /// the time is up, naming the cause: no credentials configured (and the
    /// metadata service that did not answer) or the endpoint and its address.
    /// `file://` and `memory://` stores pass at once.
    pub async fn check_contact(&self) -> Result<()> {
        self.check_contact_within(FIRST_CONTACT_TIMEOUT).await
    }

    /// [`Store::check_contact`] with another bound.
    pub async fn check_contact_within(&self, limit: Duration) -> Result<()> {
        let Some(contact) = &self.contact else {
            return Ok(());
        };
        let inner = self.inner.clone();
        let http = contact.endpoint_setting == "the store URL";
        let probe = async move {
            if http {
                match inner.head(&object_store::path::Path::from(PROBE_KEY)).await {
                    Err(object_store::Error::NotFound { .. }) => Ok(()),
                    other => other.map(|_| ()),
                }
            } else {
                inner.list_with_delimiter(None).await.map(|_| ())
            }
        };
        match tokio::time::timeout(limit, probe).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(self.err("list", "/", e)),
            Err(_) => Err(self.silent(contact, limit).await),
        }
    }

    /// The error for a store that did not answer within `limit`.
    async fn silent(&self, c: &Contact, limit: Duration) -> Error {
        let url = &self.url;
        let secs = limit.as_secs();
        let reached = try_connect(&c.endpoint).await;
        if let Some((service, settings)) = &c.no_credentials {
            let endpoint = match &reached {
                Ok(_) => String::new(),
                Err(why) => format!(
                    " (the endpoint {} cannot be reached either: {why}; check {})",
                    c.endpoint, c.endpoint_setting
                ),
            };
            return Error::Config(format!(
                "store `{url}` did not answer within {secs} s: no credentials are configured, so \
                 the client asks the metadata service at {service} for some, and nothing answers \
                 there{endpoint}. Set {settings}"
            ));
        }
        match reached {
            Err(why) => Error::Unavailable(format!(
                "store `{url}` did not answer within {secs} s: its endpoint {} cannot be reached \
                 ({why}). Check {} and that the store is running and reachable from here",
                c.endpoint, c.endpoint_setting
            )),
            Ok(addr) => Error::Unavailable(format!(
                "store `{url}` did not answer within {secs} s: its endpoint {} ({addr}) accepts \
                 connections but answered no request (the retries are in the log above). Check \
                 that {addr} is the store's API (not another service), and {}",
                c.endpoint, c.endpoint_setting
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_give_their_address() {
        assert_eq!(
            host_port("http://127.0.0.1:9000"),
            Some(("127.0.0.1".into(), 9000))
        );
        assert_eq!(
            host_port("https://b.s3.us-east-1.amazonaws.com"),
            Some(("b.s3.us-east-1.amazonaws.com".into(), 443))
        );
        assert_eq!(host_port("not a url"), None);
    }

    #[tokio::test]
    async fn local_stores_pass_at_once() {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("file://{}", dir.path().display());
        Store::open(&url).unwrap().check_contact().await.unwrap();
        Store::open("memory://")
            .unwrap()
            .check_contact()
            .await
            .unwrap();
    }
}
