//! The relay: mirrors committed versions from an origin prefix to a regional
//! prefix (any store kind to any other), so that a region's subscribers read
//! a bucket near them and each version crosses the inter-region link once.
//!
//! One sync ([`Relay::sync_once`]) compares the destination's newest
//! committed version `D` with the origin's newest `N` and copies versions in
//! order, each with the commit protocol:
//!
//! 1. the origin manifest is read and validated;
//! 2. every object it lists is copied under the same key, streaming, its size
//!    and BLAKE3 checked against the manifest entry on the way
//!    ([`Store::copy_verified`]): a corrupt origin object is never relayed
//!    (the version fails with [`Error::Integrity`] naming the object, and
//!    nothing of it is committed); an object already at the destination with
//!    the right size and BLAKE3 (a relay restarted mid-version) is not copied
//!    again;
//! 3. the same manifest is committed at the destination (create-if-absent),
//!    then `latest.json`;
//! 4. the destination's subscribers are notified in a background task
//!    ([`crate::notify::send_with`]: bounded concurrency, retries with
//!    backoff, a per-subscriber deadline), so a slow subscriber never
//!    slows the relay.
//!
//! Which versions: `D+1..=N` when the origin still has `D+1`; otherwise
//! (an empty destination, or history the origin has collected) from the
//! origin's newest anchor at or before `N` — never the whole history. Keys
//! are kept (`anchors/`, `deltas/`, `files/`, `versions/`), so a chain
//! origin → region → zone is two relays. Retention at the destination
//! follows its own registrations ([`crate::protocol::collect_garbage`]);
//! the relay never deletes at the origin.

use std::time::Duration;

use futures::StreamExt;
use serde::Serialize;

use crate::error::{Error, Result};
use crate::notify::{Key, Notification, SendPolicy};
use crate::protocol::{
    Commit, Latest, Manifest, Retention, commit, newest_version, read_manifest, write_latest,
};
use crate::store::Store;

/// Objects copied at once by default.
pub const OBJECTS_IN_FLIGHT: usize = 4;
/// Parts of a large object read ahead (and uploading) by default.
pub const PARTS_AHEAD: usize = 4;

/// How a relay copies, notifies and collects.
#[derive(Clone, Debug)]
pub struct RelayConfig {
    /// Objects copied at once ([`OBJECTS_IN_FLIGHT`]).
    pub objects_in_flight: usize,
    /// Parts of a large object read ahead, and as many uploading
    /// ([`PARTS_AHEAD`]): memory is about `objects_in_flight` × 2 ×
    /// `parts_ahead` × 16 MiB at most, whatever the model's size.
    pub parts_ahead: usize,
    /// Subscribers of the destination to notify besides those registered in it.
    pub notify_urls: Vec<String>,
    /// The notify secret; without it no notification is sent.
    pub notify_key: Option<Key>,
    /// How notifications go out.
    pub notify_policy: SendPolicy,
    /// Retention at the destination after each sync that relayed an anchor
    /// (`None`: keep everything).
    pub retention: Option<Retention>,
    /// The daemon's poll interval ([`Relay::run`]).
    pub interval: Duration,
}

impl Default for RelayConfig {
    fn default() -> Self {
        RelayConfig {
            objects_in_flight: OBJECTS_IN_FLIGHT,
            parts_ahead: PARTS_AHEAD,
            notify_urls: Vec::new(),
            notify_key: None,
            notify_policy: SendPolicy::default(),
            retention: None,
            interval: Duration::from_secs(5),
        }
    }
}

/// What one sync did.
#[derive(Clone, Debug, Default, Serialize, PartialEq, Eq)]
pub struct RelayReport {
    /// The origin's newest committed version, if any.
    pub origin: Option<u64>,
    /// The destination's newest committed version after the sync.
    pub destination: Option<u64>,
    /// Versions committed at the destination, in order.
    pub versions: Vec<u64>,
    /// Objects copied.
    pub objects: u64,
    /// Bytes copied.
    pub bytes: u64,
    /// Objects already at the destination with the right size and BLAKE3.
    pub skipped: u64,
    /// Their bytes.
    pub bytes_skipped: u64,
    /// Versions not relayed because an object or the manifest failed its
    /// check at the origin, passed over for a newer anchor.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub bypassed: Vec<u64>,
    /// What retention removed at the destination, when it ran.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub collected: Option<crate::protocol::Collected>,
}

/// Mirrors one origin prefix into one destination prefix.
pub struct Relay {
    from: Store,
    to: Store,
    cfg: RelayConfig,
    notifications: tokio::task::JoinSet<usize>,
}

impl Relay {
    /// A relay from `from` to `to`.
    pub fn new(from: Store, to: Store, cfg: RelayConfig) -> Relay {
        Relay {
            from,
            to,
            cfg,
            notifications: tokio::task::JoinSet::new(),
        }
    }

    /// The origin.
    pub fn from(&self) -> &Store {
        &self.from
    }

    /// The destination.
    pub fn to(&self) -> &Store {
        &self.to
    }

    /// Copies every committed version the destination lacks (see the module
    /// documentation), in order; stops at the first version that fails,
    /// leaving the versions before it committed.
    pub async fn sync_once(&mut self) -> Result<RelayReport> {
        // Reap finished notification tasks (they never fail).
        while self.notifications.try_join_next().is_some() {}
        let mut report = RelayReport {
            origin: newest_version(&self.from).await?,
            destination: newest_version(&self.to).await?,
            ..RelayReport::default()
        };
        let Some(newest) = report.origin else {
            return Ok(report);
        };
        let Some(first) = self.first_version(report.destination, newest).await? else {
            return Ok(report);
        };
        let mut anchored = false;
        let mut v = first;
        while v <= newest {
            let m = match self.relay_version(v, &mut report).await {
                Ok(m) => m,
                Err(e) if e.kind() == crate::error::ErrorKind::Corrupt => {
                    // A corrupt version is never relayed; a newer anchor
                    // at the origin lets the region move past it.
                    let anchor = match read_manifest(&self.from, newest).await {
                        Ok(Some(n)) => n.anchor_version,
                        _ => return Err(e),
                    };
                    if anchor <= v {
                        return Err(e);
                    }
                    tracing::warn!(
                        version = v,
                        next_anchor = anchor,
                        error = %e,
                        "refusing a corrupt origin version; relaying from the origin's newer anchor"
                    );
                    report.bypassed.extend(v..anchor);
                    v = anchor;
                    continue;
                }
                Err(e) => return Err(e),
            };
            anchored |= m.kind == crate::protocol::VersionKind::Anchor;
            report.versions.push(v);
            report.destination = Some(v);
            self.notify(&m);
            v += 1;
        }
        if anchored && let Some(r) = &self.cfg.retention {
            match crate::protocol::collect_garbage(&self.to, r, false).await {
                Ok(c) => report.collected = Some(c),
                Err(e) => tracing::warn!(error = %e, "retention at the destination failed"),
            }
        }
        Ok(report)
    }

    /// Copies version `v` and commits it at the destination.
    async fn relay_version(&self, v: u64, report: &mut RelayReport) -> Result<Manifest> {
        let m = read_manifest(&self.from, v).await?.ok_or_else(|| {
            Error::NotFound(format!(
                "version {v} vanished from the origin `{}` while being relayed \
                 (retention there?); the next sync starts from its newest anchor",
                self.from.url()
            ))
        })?;
        self.copy_objects(&m, report).await?;
        self.commit(&m).await?;
        tracing::info!(
            version = v,
            kind = ?m.kind,
            from = self.from.url(),
            to = self.to.url(),
            "relayed"
        );
        Ok(m)
    }

    /// The first version to copy, or `None` when the destination is current.
    async fn first_version(&self, held: Option<u64>, newest: u64) -> Result<Option<u64>> {
        if let Some(d) = held {
            if d >= newest {
                if d > newest {
                    tracing::warn!(
                        destination = d,
                        origin = newest,
                        "the destination is ahead of the origin (was the origin reset?); \
                         nothing to relay until the origin passes it"
                    );
                }
                return Ok(None);
            }
            // Every committed version follows the one before (a delta, or an
            // anchor), so the origin's next one is all a replay needs.
            // (A corrupt one is tried, refused and passed over by the sync.)
            match read_manifest(&self.from, d + 1).await {
                Ok(Some(_)) => return Ok(Some(d + 1)),
                Err(e) if e.kind() == crate::error::ErrorKind::Corrupt => return Ok(Some(d + 1)),
                Ok(None) => {}
                Err(e) => return Err(e),
            }
        }
        let m = read_manifest(&self.from, newest).await?.ok_or_else(|| {
            Error::NotFound(format!(
                "version {newest} vanished from the origin `{}` while being read",
                self.from.url()
            ))
        })?;
        Ok(Some(m.anchor_version))
    }

    /// Copies the objects of `m`, [`RelayConfig::objects_in_flight`] at a
    /// time, skipping those already in place.
    async fn copy_objects(&self, m: &Manifest, report: &mut RelayReport) -> Result<()> {
        let ahead = self.cfg.parts_ahead;
        let mut copies = futures::stream::iter(m.objects.clone())
            .map(|o| copy_one(self.from.clone(), self.to.clone(), o, ahead))
            .buffer_unordered(self.cfg.objects_in_flight.max(1));
        while let Some(r) = copies.next().await {
            let (copied, size) = r.map_err(|e| {
                tracing::error!(version = m.version, error = %e, "relaying the version failed; nothing of it is committed");
                e
            })?;
            if copied {
                report.objects += 1;
                report.bytes += size;
            } else {
                report.skipped += 1;
                report.bytes_skipped += size;
            }
        }
        Ok(())
    }

    /// Commits `m` at the destination, then its hint.
    async fn commit(&self, m: &Manifest) -> Result<()> {
        crate::failpoint::hit("relay.before_commit");
        match commit(&self.to, m).await? {
            Commit::Committed => {}
            Commit::VersionTaken => {
                return Err(Error::Conflict(format!(
                    "version {} at `{}` was committed by another writer than the origin's: \
                     a relay's destination must be written by that relay only",
                    m.version,
                    self.to.url()
                )));
            }
        }
        write_latest(
            &self.to,
            &Latest {
                version: m.version,
                anchor_version: m.anchor_version,
            },
        )
        .await
    }

    /// Notifies the destination's fleet of `m` in the background.
    fn notify(&mut self, m: &Manifest) {
        let Some(key) = self.cfg.notify_key.clone() else {
            return;
        };
        let (store, urls, policy) = (
            self.to.clone(),
            self.cfg.notify_urls.clone(),
            self.cfg.notify_policy,
        );
        let max_age = crate::notify::registration_horizon(self.cfg.retention.as_ref());
        let n = Notification {
            store: self.to.url().to_string(),
            version: m.version,
            anchor_version: m.anchor_version,
        };
        self.notifications.spawn(async move {
            let urls = crate::notify::fleet_urls(&store, &urls, max_age).await;
            let d = crate::notify::send_with(&urls, &key, &n, &policy).await;
            d.iter().filter(|d| d.ok).count()
        });
    }

    /// Waits for the notifications sent so far; returns how many subscribers
    /// acknowledged them.
    pub async fn notifications_settled(&mut self) -> usize {
        let mut ok = 0;
        while let Some(r) = self.notifications.join_next().await {
            ok += r.unwrap_or(0);
        }
        ok
    }

    /// The daemon: syncs, then waits [`RelayConfig::interval`] or until
    /// `wake` is notified (a notification from the origin's publisher), and
    /// again, until `shutdown` completes. Between syncs it polls the
    /// origin's `latest.json` with a conditional GET (and lists `versions/`
    /// every few polls, as a subscriber does), so an idle relay costs one
    /// small request per interval. Each sync's outcome goes to `on_sync`;
    /// a failed sync is retried at the next poll.
    pub async fn run(
        mut self,
        wake: &tokio::sync::Notify,
        mut on_sync: impl FnMut(&Result<RelayReport>),
        shutdown: impl Future<Output = ()>,
    ) {
        use crate::subscriber::fetch::Fetcher;
        use crate::subscriber::source::{Seen, VersionSource};
        tokio::pin!(shutdown);
        let origin = Fetcher::new(self.from.clone());
        let mut source = VersionSource::new(self.cfg.interval, 0.1);
        let mut held: Option<u64> = None;
        let mut thorough = true;
        loop {
            let due = match source.check(&origin, held, thorough).await {
                Ok(Seen::Same) => false,
                Ok(_) => true,
                Err(e) => {
                    tracing::warn!(error = %e, "cannot read the origin; retrying at the next poll");
                    false
                }
            };
            if due {
                let r = tokio::select! {
                    _ = &mut shutdown => return,
                    r = self.sync_once() => r,
                };
                if let Ok(rep) = &r {
                    held = rep.destination.filter(|&d| Some(d) == rep.origin);
                }
                on_sync(&r);
            }
            thorough = tokio::select! {
                _ = &mut shutdown => return,
                woken = source.wait(wake) => woken,
            };
        }
    }
}

/// Copies one object unless the destination already holds it with the
/// manifest's size and BLAKE3; returns whether it was copied, and its size.
async fn copy_one(
    from: Store,
    to: Store,
    o: crate::protocol::ObjectEntry,
    ahead: usize,
) -> Result<(bool, u64)> {
    if to.head(&o.key).await? == Some(o.size)
        && let Some((size, hash)) = to.measure(&o.key).await?
        && size == o.size
        && hash == o.blake3
    {
        return Ok((false, o.size));
    }
    from.copy_verified(&to, &o.key, (o.size, &o.blake3), ahead)
        .await?;
    Ok((true, o.size))
}
