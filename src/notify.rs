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
        // The sender's request is refused: not a configuration error here.
        let denied = |why: &str| Err(Error::BadRequest(format!("notification refused: {why}")));
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

/// How notifications go out: at most `concurrency` subscribers at once, each
/// attempt bounded by `attempt_timeout`, up to `attempts` attempts with
/// exponential backoff (200 ms, 400 ms, …), and all of one subscriber's
/// attempts within `deadline`. A 4xx answer is final (no retry).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SendPolicy {
    /// Subscribers notified at once.
    pub concurrency: usize,
    /// Longest one attempt may take.
    pub attempt_timeout: Duration,
    /// Attempts per subscriber.
    pub attempts: u32,
    /// Longest one subscriber may take, retries included.
    pub deadline: Duration,
}

impl Default for SendPolicy {
    fn default() -> Self {
        SendPolicy {
            concurrency: 32,
            attempt_timeout: Duration::from_secs(2),
            attempts: 3,
            deadline: Duration::from_secs(10),
        }
    }
}

/// Sends `n` to every URL with the default [`SendPolicy`]. Never fails:
/// deliveries are reported, errors logged.
pub async fn send(urls: &[String], key: &Key, n: &Notification) -> Vec<Delivery> {
    send_with(urls, key, n, &SendPolicy::default()).await
}

/// Sends `n` to every URL under `policy` (see [`SendPolicy`]). Never fails:
/// deliveries are reported, errors logged.
pub async fn send_with(
    urls: &[String],
    key: &Key,
    n: &Notification,
    policy: &SendPolicy,
) -> Vec<Delivery> {
    use futures::StreamExt;
    crate::store::install_crypto_provider();
    let client = match reqwest::Client::builder()
        .timeout(policy.attempt_timeout)
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
    let one = |url: String| {
        let (client, body) = (client.clone(), body.clone());
        async move {
            let attempts = std::sync::atomic::AtomicU32::new(0);
            let tries = async {
                loop {
                    let made = attempts.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
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
                        Ok(resp) if resp.status().is_success() => return true,
                        Ok(resp) if resp.status().is_client_error() => {
                            tracing::warn!(%url, status = %resp.status(), "notification refused");
                            return false;
                        }
                        other => {
                            if made >= policy.attempts.max(1) {
                                tracing::warn!(%url, result = ?other.map(|r| r.status()), "notification not delivered");
                                return false;
                            }
                            tokio::time::sleep(Duration::from_millis(100 << made.min(8))).await;
                        }
                    }
                }
            };
            let ok = match tokio::time::timeout(policy.deadline, tries).await {
                Ok(ok) => ok,
                Err(_) => {
                    tracing::warn!(%url, deadline = ?policy.deadline, "notification not delivered within its deadline");
                    false
                }
            };
            Delivery {
                url,
                ok,
                attempts: attempts.into_inner(),
            }
        }
    };
    futures::stream::iter(urls.iter().cloned())
        .map(one)
        .buffer_unordered(policy.concurrency.max(1))
        .collect()
        .await
}

/// The notify URL a subscriber listening on `bound` registers when no
/// `advertise` URL is given: `http://<bound>/v1/notify`. Refused for an
/// unspecified address (`0.0.0.0`, `::`): a publisher on another host would
/// dial itself, so the caller must say where it is reached.
pub fn default_notify_url(bound: std::net::SocketAddr) -> Result<String> {
    if bound.ip().is_unspecified() {
        return Err(Error::Config(format!(
            "listening on {bound} (every interface), the address to register is unknown: give \
             the URL publishers reach this subscriber at (--advertise / advertise=, e.g. \
             http://<this host>:{}/v1/notify)",
            bound.port()
        )));
    }
    Ok(format!("http://{bound}/v1/notify"))
}

/// How old a registration may be and still be notified: the retention's
/// registration horizon (a day by default), so that a subscriber retention
/// has given up on is not sent POSTs either.
pub fn registration_horizon(retention: Option<&crate::protocol::Retention>) -> u64 {
    retention
        .and_then(|r| r.registration_max_age_s)
        .or(crate::protocol::Retention::default().registration_max_age_s)
        .unwrap_or(u64::MAX)
}

/// The notify URLs of a store's fleet: `static_urls` plus those of the
/// subscribers registered in `store` whose registration was refreshed
/// within `max_age_s` seconds (an older one belongs to a subscriber that
/// went away: not worth a POST), sorted, without duplicates. A registry that
/// cannot be listed is logged and leaves the static URLs.
pub async fn fleet_urls(
    store: &crate::store::Store,
    static_urls: &[String],
    max_age_s: u64,
) -> Vec<String> {
    let mut urls = static_urls.to_vec();
    let now = unix_now();
    match crate::protocol::registrations(store).await {
        Ok(regs) => urls.extend(
            regs.into_iter()
                .filter(|r| now.saturating_sub(r.updated_at) <= max_age_s)
                .filter_map(|r| r.notify_url),
        ),
        Err(e) => tracing::warn!(error = %e, "cannot list subscriber registrations"),
    }
    urls.sort();
    urls.dedup();
    urls
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A loopback HTTP server: answers every request with `status` (reading
    /// nothing of it), or never answers when `status` is `None`.
    async fn server(status: Option<u16>) -> String {
        use tokio::io::AsyncWriteExt;
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/v1/notify", l.local_addr().unwrap());
        tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((mut c, _)) = l.accept().await {
                match status {
                    Some(s) => {
                        // Read the request (headers, then the body) first.
                        use tokio::io::AsyncReadExt;
                        let mut req = Vec::new();
                        let mut buf = [0u8; 4096];
                        while let Ok(k) = c.read(&mut buf).await {
                            req.extend_from_slice(&buf[..k]);
                            let text = String::from_utf8_lossy(&req).to_lowercase();
                            if let Some(end) = text.find("\r\n\r\n") {
                                let len: usize = text
                                    .split("content-length:")
                                    .nth(1)
                                    .and_then(|v| v.lines().next())
                                    .and_then(|v| v.trim().parse().ok())
                                    .unwrap_or(0);
                                if req.len() >= end + 4 + len {
                                    break;
                                }
                            }
                            if k == 0 {
                                break;
                            }
                        }
                        let r = format!(
                            "HTTP/1.1 {s} X\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
                        );
                        c.write_all(r.as_bytes()).await.ok();
                    }
                    None => held.push(c),
                }
            }
        });
        url
    }

    #[tokio::test]
    async fn a_silent_subscriber_hits_its_deadline_and_slows_no_other() {
        let key = Key::new("0123456789abcdef-secret").unwrap();
        let n = Notification {
            store: "memory://".into(),
            version: 1,
            anchor_version: 0,
        };
        let (silent, ok, refused) = (
            server(None).await,
            server(Some(200)).await,
            server(Some(403)).await,
        );
        let policy = SendPolicy {
            concurrency: 2,
            attempt_timeout: Duration::from_secs(30),
            attempts: 3,
            deadline: Duration::from_millis(300),
        };
        let t = std::time::Instant::now();
        let urls = [silent.clone(), ok.clone(), refused.clone(), ok.clone()];
        let mut got = send_with(&urls, &key, &n, &policy).await;
        let took = t.elapsed();
        got.sort_by(|a, b| a.url.cmp(&b.url));
        let by = |u: &str| {
            got.iter()
                .filter(|d| d.url == u)
                .cloned()
                .collect::<Vec<_>>()
        };
        assert!(
            by(&silent).iter().all(|d| !d.ok && d.attempts == 1),
            "{got:?}"
        );
        assert!(by(&ok).iter().all(|d| d.ok && d.attempts == 1), "{got:?}");
        assert!(
            by(&refused).iter().all(|d| !d.ok && d.attempts == 1),
            "{got:?}"
        );
        assert_eq!(got.len(), 4);
        // The silent one held one of the two slots for its deadline only.
        assert!(took < Duration::from_secs(5), "{took:?}");
        assert!(took >= Duration::from_millis(300), "{took:?}");
    }

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

    #[test]
    fn the_default_notify_url_needs_a_reachable_address() {
        let url = default_notify_url("127.0.0.1:8471".parse().unwrap()).unwrap();
        assert_eq!(url, "http://127.0.0.1:8471/v1/notify");
        for every in ["0.0.0.0:8471", "[::]:8471"] {
            let e = default_notify_url(every.parse().unwrap()).unwrap_err();
            assert_eq!(e.kind(), crate::error::ErrorKind::Config);
            assert!(
                e.to_string().contains("advertise") && e.to_string().contains(":8471"),
                "{e}"
            );
        }
    }
}
