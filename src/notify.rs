//! Notifications: after each commit the publisher POSTs a tiny, authenticated
//! message to every subscriber it knows; subscribers treat it only as a hint to
//! look at the bucket now instead of at the next poll.
//!
//! Message: `{"store": "<url>", "version": <u64>, "anchor_version": <u64>}`
//! (never weights). Authentication: a shared secret; the publisher sends
//!
//! ```text
//! X-Weightcast-Timestamp: <unix seconds>
//! X-Weightcast-Signature: v1=<hex BLAKE3 keyed hash of "<timestamp>.<body>">
//! ```
//!
//! keyed with `BLAKE3-derive_key("weightcast notify v1", secret)`. A receiver
//! accepts a message only if the signature matches and the timestamp is within
//! five minutes of its clock (which bounds replays; a replayed hint at worst
//! triggers one extra look at the bucket).
//!
//! Subscribers register themselves in the bucket under `subscribers/<id>.json`
//! (their notify URL and version), so a publisher discovers the fleet without
//! configuration; static URLs can be given too.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
pub use crate::protocol::registry::unix_now;

/// Header carrying the signature.
pub const SIGNATURE_HEADER: &str = "x-weightcast-signature";
/// Header carrying the timestamp.
pub const TIMESTAMP_HEADER: &str = "x-weightcast-timestamp";
/// Accepted clock difference.
pub const MAX_SKEW: Duration = Duration::from_secs(300);
/// Largest notification body a receiver reads.
pub const MAX_BODY: usize = 4096;

/// The notification.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Notification {
    /// The store URL the version was committed to.
    pub store: String,
    /// The committed version.
    pub version: u64,
    /// Its newest anchor.
    pub anchor_version: u64,
}

/// A shared secret, turned into a MAC key.
#[derive(Clone)]
pub struct Key([u8; 32]);

impl PartialEq for Key {
    /// Constant-time comparison (through `blake3::Hash`).
    fn eq(&self, other: &Key) -> bool {
        blake3::Hash::from(self.0) == blake3::Hash::from(other.0)
    }
}

impl Eq for Key {}

impl std::fmt::Debug for Key {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Key(..)")
    }
}

impl Key {
    /// Derives the key from a secret (at least 16 bytes).
    pub fn new(secret: &str) -> Result<Key> {
        if secret.len() < 16 {
            return Err(Error::Config(
                "the notify secret must be at least 16 characters".into(),
            ));
        }
        Ok(Key(blake3::derive_key(
            "weightcast notify v1",
            secret.as_bytes(),
        )))
    }

    /// The signature header value for `body` at `timestamp`.
    pub fn sign(&self, timestamp: u64, body: &[u8]) -> String {
        let mut h = blake3::Hasher::new_keyed(&self.0);
        h.update(timestamp.to_string().as_bytes());
        h.update(b".");
        h.update(body);
        format!("v1={}", h.finalize().to_hex())
    }

    /// Checks a received message (constant-time comparison of the MAC).
    pub fn verify(
        &self,
        timestamp: Option<&str>,
        signature: Option<&str>,
        body: &[u8],
        now: u64,
    ) -> Result<()> {
        let denied = |why: &str| Err(Error::Config(format!("notification refused: {why}")));
        let Some(ts) = timestamp.and_then(|t| t.parse::<u64>().ok()) else {
            return denied("missing or malformed timestamp");
        };
        if ts.abs_diff(now) > MAX_SKEW.as_secs() {
            return denied("timestamp too far from this clock");
        }
        let Some(sig) = signature.and_then(|s| s.strip_prefix("v1=")) else {
            return denied("missing or malformed signature");
        };
        let Ok(got) = blake3::Hash::from_hex(sig) else {
            return denied("malformed signature");
        };
        let mut h = blake3::Hasher::new_keyed(&self.0);
        h.update(ts.to_string().as_bytes());
        h.update(b".");
        h.update(body);
        // blake3::Hash equality is constant-time.
        if h.finalize() != got {
            return denied("bad signature");
        }
        Ok(())
    }
}

/// Outcome of notifying one subscriber.
#[derive(Clone, Debug, Serialize)]
pub struct Delivery {
    /// The URL.
    pub url: String,
    /// Whether a 2xx answer came back.
    pub ok: bool,
    /// Attempts made.
    pub attempts: u32,
}

/// Sends `n` to every URL concurrently: 2 s timeout per attempt, up to three
/// attempts with backoff. Never fails: deliveries are reported, errors logged.
pub async fn send(urls: &[String], key: &Key, n: &Notification) -> Vec<Delivery> {
    let client = match reqwest::Client::builder()
        .timeout(Duration::from_secs(2))
        .redirect(reqwest::redirect::Policy::none())
        .build()
    {
        Ok(c) => c,
        Err(e) => {
            tracing::error!(error = %e, "cannot build the notify client");
            return Vec::new();
        }
    };
    let body = serde_json::to_vec(n).expect("notification serializes");
    let tasks = urls.iter().map(|url| {
        let (client, body, url) = (client.clone(), body.clone(), url.clone());
        async move {
            let mut attempts = 0;
            loop {
                attempts += 1;
                let ts = unix_now();
                let r = client
                    .post(&url)
                    .header("content-type", "application/json")
                    .header(TIMESTAMP_HEADER, ts.to_string())
                    .header(SIGNATURE_HEADER, key.sign(ts, &body))
                    .body(body.clone())
                    .send()
                    .await;
                match r {
                    Ok(resp) if resp.status().is_success() => {
                        return Delivery { url, ok: true, attempts };
                    }
                    Ok(resp) if resp.status().is_client_error() => {
                        tracing::warn!(%url, status = %resp.status(), "notification refused");
                        return Delivery { url, ok: false, attempts };
                    }
                    other => {
                        if attempts >= 3 {
                            tracing::warn!(%url, result = ?other.map(|r| r.status()), "notification not delivered");
                            return Delivery { url, ok: false, attempts };
                        }
                        tokio::time::sleep(Duration::from_millis(200 << attempts)).await;
                    }
                }
            }
        }
    });
    futures::future::join_all(tasks).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signatures_verify_and_reject() {
        let k = Key::new("0123456789abcdef-secret").unwrap();
        let body = br#"{"store":"s3://b","version":3,"anchor_version":0}"#;
        let now = 1_700_000_000;
        let sig = k.sign(now, body);
        let ts = now.to_string();
        assert!(k.verify(Some(&ts), Some(&sig), body, now).is_ok());
        assert!(k.verify(Some(&ts), Some(&sig), body, now + 299).is_ok());
        assert!(
            k.verify(Some(&ts), Some(&sig), body, now + 301).is_err(),
            "stale"
        );
        assert!(
            k.verify(Some(&ts), Some(&sig), b"{}", now).is_err(),
            "other body"
        );
        assert!(k.verify(None, Some(&sig), body, now).is_err());
        assert!(k.verify(Some(&ts), None, body, now).is_err());
        assert!(k.verify(Some(&ts), Some("v1=zz"), body, now).is_err());
        let other = Key::new("another-secret-of-16+").unwrap();
        assert!(
            other.verify(Some(&ts), Some(&sig), body, now).is_err(),
            "other key"
        );
        assert!(Key::new("short").is_err());
    }
}
