//! The registration cadence: a subscriber with an id keeps
//! `subscribers/<id>.json` in the bucket current (its version, its
//! quarantined versions, where to notify it), so that publishers notify it
//! and retention keeps what it replays. Rewritten when the version or the
//! quarantine changed, and every [`REGISTRATION_REFRESH`] otherwise; the
//! daemon and the Python binding share this one cadence.

use std::time::{Duration, Instant};

use crate::protocol::Registration;

use super::fetch::Fetcher;

/// How often a subscriber that stays at one version rewrites its registration
/// (a new version rewrites it at once). Well inside the publishers' default
/// registration horizon of a day.
pub const REGISTRATION_REFRESH: Duration = Duration::from_secs(600);

/// Quarantined versions a registration lists at most (the newest).
const REGISTERED_QUARANTINE: usize = 16;

/// One subscriber's registration and when it was last written.
#[derive(Clone, Debug)]
pub struct Registrar {
    id: Option<String>,
    notify_url: Option<String>,
    /// (version, quarantined, when) of the last registration written.
    last: Option<(Option<u64>, Vec<u64>, Instant)>,
}

impl Registrar {
    /// Registers as `id` (nothing when `None`) with the URL publishers POST
    /// notifications to.
    pub fn new(id: Option<String>, notify_url: Option<String>) -> Registrar {
        Registrar {
            id,
            notify_url,
            last: None,
        }
    }

    /// The URL registered for notifications.
    pub fn notify_url(&self) -> Option<&str> {
        self.notify_url.as_deref()
    }

    /// The registration to write now, if one is due.
    pub fn due(&self, version: Option<u64>, quarantined: &[u64]) -> Option<Registration> {
        let id = self.id.clone()?;
        let mut quarantined = quarantined.to_vec();
        // The newest few only: a registration must stay under its 4 KiB
        // bound however many bad versions pile up.
        quarantined.truncate(REGISTERED_QUARANTINE);
        let due = self.last.as_ref().is_none_or(|(v, q, at)| {
            *v != version || *q != quarantined || at.elapsed() >= REGISTRATION_REFRESH
        });
        due.then(|| Registration {
            id,
            notify_url: self.notify_url.clone(),
            version,
            quarantined,
            updated_at: crate::notify::unix_now(),
        })
    }

    /// Records that `reg` was written.
    pub fn written(&mut self, reg: &Registration) {
        self.last = Some((reg.version, reg.quarantined.clone(), Instant::now()));
    }

    /// Writes the registration through `fetcher` when it is due (a failure
    /// is logged, and the next call tries again).
    pub async fn refresh(&mut self, fetcher: &Fetcher, version: Option<u64>, quarantined: &[u64]) {
        let Some(reg) = self.due(version, quarantined) else {
            return;
        };
        fetcher.count(1);
        match crate::protocol::register(fetcher.store(), &reg).await {
            Ok(()) => self.written(&reg),
            Err(e) => tracing::warn!(error = %e, "registration failed"),
        }
    }
}
