//! Subscriber registrations (`subscribers/<id>.json`) and the fleet view built
//! from them: how publishers find subscribers to notify, how retention knows
//! which versions a lagging subscriber still replays, and what `weightcast
//! status` shows.

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::store::Store;

use super::layout::SUBSCRIBERS_PREFIX;

/// Largest registration a reader accepts.
pub const MAX_REGISTRATION_BYTES: u64 = 4096;

/// Seconds since the Unix epoch, by this host's clock.
pub fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// A subscriber's registration in the bucket.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Registration {
    /// Stable subscriber id (file-name safe).
    pub id: String,
    /// Where it receives notifications, if it listens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub notify_url: Option<String>,
    /// The version it holds.
    pub version: Option<u64>,
    /// Versions it could not verify and skips (quarantined), newest first.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub quarantined: Vec<u64>,
    /// When it last wrote this, Unix seconds.
    pub updated_at: u64,
}

/// Whether `id` is usable as a registration id.
pub fn valid_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 128
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.')
        && !id.starts_with('.')
}

/// Writes (or refreshes) a registration.
pub async fn register(store: &Store, reg: &Registration) -> Result<()> {
    if !valid_id(&reg.id) {
        return Err(Error::BadRequest(format!(
            "subscriber id `{}` must be [A-Za-z0-9._-]{{1,128}}",
            reg.id
        )));
    }
    let body = serde_json::to_vec(reg).expect("registration serializes");
    store
        .put(
            &format!("{SUBSCRIBERS_PREFIX}/{}.json", reg.id),
            Bytes::from(body),
        )
        .await
}

/// Reads every registration (unreadable ones are skipped with a warning: the
/// bucket is shared, not trusted).
pub async fn registrations(store: &Store) -> Result<Vec<Registration>> {
    use futures::StreamExt;
    let listed = store.list(SUBSCRIBERS_PREFIX).await?;
    let read = |l: crate::store::Listed| async move {
        if l.size > MAX_REGISTRATION_BYTES {
            tracing::warn!(key = %l.key, "oversized registration ignored");
            return None;
        }
        // The listing's size is only a hint: the read enforces the limit too.
        let body = match store.get_at_most(&l.key, MAX_REGISTRATION_BYTES).await {
            Ok(Some(body)) => body,
            Ok(None) => return None,
            Err(e) => {
                tracing::warn!(key = %l.key, error = %e, "unreadable registration ignored");
                return None;
            }
        };
        match serde_json::from_slice::<Registration>(&body) {
            Ok(r) if valid_id(&r.id) => Some(r),
            _ => {
                tracing::warn!(key = %l.key, "malformed registration ignored");
                None
            }
        }
    };
    // A fleet of hundreds is read in a few round trips, not one per member.
    let out: Vec<Registration> = futures::stream::iter(listed)
        .map(read)
        .buffered(REGISTRATIONS_IN_FLIGHT)
        .filter_map(std::future::ready)
        .collect()
        .await;
    Ok(out)
}

/// Registrations read at once.
const REGISTRATIONS_IN_FLIGHT: usize = 32;

/// One subscriber in the fleet view.
#[derive(Clone, Debug, Serialize)]
pub struct FleetMember {
    /// Its registration.
    #[serde(flatten)]
    pub registration: Registration,
    /// Committed versions it has not applied.
    pub lag: Option<u64>,
    /// Seconds since it last wrote its registration.
    pub seen_seconds_ago: u64,
}

/// The fleet view behind `weightcast status`.
#[derive(Clone, Debug, Serialize)]
pub struct Fleet {
    /// The newest committed version.
    pub newest: Option<u64>,
    /// Registered subscribers, by id.
    pub subscribers: Vec<FleetMember>,
}

/// Reads the newest version and every registration.
pub async fn fleet(store: &Store) -> Result<Fleet> {
    let newest = super::commit::versions_after(store, None)
        .await?
        .last()
        .copied();
    let now = unix_now();
    let mut subscribers: Vec<FleetMember> = registrations(store)
        .await?
        .into_iter()
        .map(|r| FleetMember {
            lag: newest.zip(r.version).map(|(n, v)| n.saturating_sub(v)),
            seen_seconds_ago: now.saturating_sub(r.updated_at),
            registration: r,
        })
        .collect();
    subscribers.sort_by(|a, b| a.registration.id.cmp(&b.registration.id));
    Ok(Fleet {
        newest,
        subscribers,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids() {
        assert!(valid_id("rollout-7.eu_west"));
        for bad in ["", ".hidden", "a/b", "../x", "a b"] {
            assert!(!valid_id(bad), "{bad}");
        }
    }
}
