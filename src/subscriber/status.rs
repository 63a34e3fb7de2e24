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
    /// The version the engine hooks last confirmed (every hook succeeded
    /// for it); `None` until a hook run of this process confirms one. A
    /// version an engine refused (an error, or `{"success": false}`) is not
    /// served: this stays at the previous one while the hooks are owed.
    pub served_version: Option<u64>,
    /// Versions that could not be verified and are skipped (retried with
    /// backoff), newest first.
    pub quarantined: Vec<crate::subscriber::Quarantined>,
    /// The version each rank of a tensor-parallel engine holds, by rank,
    /// when one node subscriber follows for all of them (empty otherwise).
    /// Ranks that differ are an error (`last_error`, `/healthz` 503).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub rank_versions: Vec<Option<u64>>,
    /// The directory engines load (`DIR/current`), absolute.
    pub dir: Option<std::path::PathBuf>,
    /// The last version's time waiting on the store, seconds
    /// ([`crate::subscriber::CaughtUp::fetch_s`]).
    pub fetch_s: f64,
    /// The last version's time decoding, verifying and writing it where
    /// nothing reads it yet, seconds.
    pub prepare_s: f64,
    /// The last version's engine pause, seconds (hooks; 0 without).
    pub pause_s: f64,
    /// The last version's time making it visible (commit and switch), seconds.
    pub apply_s: f64,
    /// The last version that changed the output, accounted: its time split
    /// and its own bytes (the counters above are since start).
    pub last_version: Option<VersionAccount>,
}

/// One version's account: where the time and the bytes went.
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct VersionAccount {
    /// The version.
    pub version: u64,
    /// Waiting on the store, seconds.
    pub fetch_s: f64,
    /// Decoding, verifying, writing off the serving path, seconds.
    pub prepare_s: f64,
    /// The engine's pause, seconds.
    pub pause_s: f64,
    /// Commit and switch, seconds.
    pub apply_s: f64,
    /// Bytes downloaded for it.
    pub bytes_downloaded: u64,
    /// Bytes written locally for it.
    pub bytes_written: u64,
}

impl VersionAccount {
    /// The account of a catch-up's version.
    pub fn of(c: &crate::subscriber::CaughtUp) -> VersionAccount {
        VersionAccount {
            version: c.version,
            fetch_s: c.fetch_s,
            prepare_s: c.prepare_s,
            pause_s: c.pause_s,
            apply_s: c.apply_s,
            bytes_downloaded: c.bytes_downloaded,
            bytes_written: c.bytes_written,
        }
    }
}

impl Status {
    /// Records the version each rank holds; ranks that differ are reported
    /// as the last error (cleared when they agree again).
    pub fn record_ranks(&mut self, versions: Vec<Option<u64>>) {
        let differ = versions.windows(2).any(|w| w[0] != w[1]);
        const PREFIX: &str = "ranks hold different versions";
        if differ {
            self.last_error = Some(format!("{PREFIX}: {versions:?}"));
        } else if self
            .last_error
            .as_deref()
            .is_some_and(|e| e.starts_with(PREFIX))
        {
            self.last_error = None;
        }
        self.rank_versions = versions;
    }

    /// Whether the ranks reported hold different versions.
    pub fn ranks_differ(&self) -> bool {
        self.rank_versions.windows(2).any(|w| w[0] != w[1])
    }

    /// Records a version's account as the last one.
    pub fn account(&mut self, a: VersionAccount) {
        self.fetch_s = a.fetch_s;
        self.prepare_s = a.prepare_s;
        self.pause_s = a.pause_s;
        self.apply_s = a.apply_s;
        self.last_version = Some(a);
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_on_different_versions_are_an_error_until_they_agree() {
        let mut s = Status::default();
        s.record_ranks(vec![Some(3), Some(3)]);
        assert!(!s.ranks_differ() && s.last_error.is_none());
        s.record_ranks(vec![Some(3), Some(2), Some(3)]);
        assert!(s.ranks_differ());
        assert!(
            s.last_error
                .as_deref()
                .unwrap()
                .contains("[Some(3), Some(2), Some(3)]")
        );
        s.record_ranks(vec![Some(4), Some(4), Some(4)]);
        assert!(!s.ranks_differ() && s.last_error.is_none());
        // Another error stays.
        s.last_error = Some("the store is unreachable".into());
        s.record_ranks(vec![Some(4), Some(4)]);
        assert_eq!(s.last_error.as_deref(), Some("the store is unreachable"));
    }
}
