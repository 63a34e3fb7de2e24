//! The subscriber daemon's shared state: its status (what `/v1/status` and
//! `/metrics` report) and the wake-up the notify endpoint pulls.

use std::sync::{Arc, Mutex};

use serde::Serialize;
use tokio::sync::Notify;

use crate::notify::Key;

/// What `/v1/status` reports.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Status {
    /// The verified version materialized in the output directory.
    pub version: Option<u64>,
    /// The newest committed version seen in the bucket.
    pub newest: Option<u64>,
    /// `newest - version`.
    pub lag: Option<u64>,
    /// The last catch-up error, cleared by the next success.
    pub last_error: Option<String>,
    /// Versions applied since start.
    pub versions_applied: u64,
    /// Bytes downloaded since start.
    pub bytes_downloaded: u64,
    /// Bytes written into output slots since start (anchors, files, changed
    /// elements patched in place, slot rebuilds).
    pub bytes_written: u64,
    /// Bytes of journal objects applied to bring slots forward since start.
    pub bytes_journal: u64,
    /// Bytes the catch-ups caused to be written to local storage since start
    /// (`write_bytes` of `/proc/self/io`: slots, journal and state on a disk;
    /// nothing on tmpfs).
    pub local_write_bytes: u64,
    /// The same for the last catch-up that changed the version, its standby
    /// slot brought forward included.
    pub last_local_write_bytes: u64,
    /// Requests made to the store since start (listings, manifests, hints,
    /// object reads and ranged parts, registrations).
    pub store_requests: u64,
    /// Re-bootstraps after a failed replay.
    pub repairs: u64,
    /// Catch-ups that failed.
    pub failures: u64,
    /// Accepted notifications.
    pub notifications: u64,
    /// Refused notifications (authentication, size, format).
    pub refused: u64,
    /// Seconds spent in the last catch-up that changed the version.
    pub last_apply_seconds: f64,
    /// The engine's pause window for the last version (pause answered → resume answered).
    pub last_pause_seconds: f64,
    /// Hooks that failed.
    pub hook_failures: u64,
    /// Hook runs (each version, and each retry of owed hooks).
    pub hook_runs: u64,
    /// The last hook failures, cleared when the hooks succeed.
    pub last_hook_error: Option<String>,
    /// Versions that could not be verified and are skipped (retried with
    /// backoff), newest first.
    pub quarantined: Vec<crate::subscriber::Quarantined>,
}

/// State shared by the HTTP handlers and the catch-up loop.
pub struct Shared {
    /// The status.
    pub status: Mutex<Status>,
    /// Wakes the catch-up loop.
    pub wake: Notify,
    /// The notify secret; without one every notification is refused.
    pub key: Option<Key>,
    /// The store URL this subscriber follows (notifications for others are refused).
    pub store_url: String,
    /// Signatures of accepted notifications within the accepted clock skew:
    /// a replayed notification is refused (it could otherwise make the
    /// subscriber read the bucket for as long as its timestamp stays fresh).
    pub seen: Mutex<std::collections::VecDeque<(u64, [u8; 32])>>,
}

impl Shared {
    /// Shared state for a subscriber of `store_url`.
    pub fn new(store_url: impl Into<String>, key: Option<Key>) -> Arc<Shared> {
        Arc::new(Shared {
            status: Mutex::new(Status::default()),
            wake: Notify::new(),
            key,
            store_url: store_url.into(),
            seen: Mutex::new(std::collections::VecDeque::new()),
        })
    }
}
