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
//! Which versions: `D+1..=N` when the origin's history continues the
//! destination's; otherwise (an empty destination, or history the origin
//! has collected) from the origin's newest anchor at or before `N` — never
//! the whole history. Keys are kept (`anchors/`, `deltas/`, `files/`,
//! `versions/`), so a chain origin → region → zone is two relays. Retention
//! at the destination follows its own registrations
//! ([`crate::protocol::collect_garbage`]); the relay never deletes at the
//! origin.
//!
//! **One lineage.** Version numbers alone do not say that two buckets hold
//! the same history: an origin wiped and published again from a fresh state
//! numbers its versions from 0 again, and its version `D+1` is a delta on
//! *its* `D`, not on the destination's. Before a version with a base
//! (`base_version = v − 1`: a delta, or a bridged anchor) is copied, the
//! origin's manifest of `v − 1` must be the destination's (the same commit:
//! writer, objects, BLAKE3s — writer tokens are random per commit). When it
//! is not (the origin was reset, a foreign writer wrote either side):
//!
//! - a delta is never copied: the relay starts a **new lineage** at the
//!   origin's newest anchor if that anchor is numbered after everything the
//!   destination holds (copied without its bridges, which belong to the
//!   other history: subscribers bootstrap from it cleanly), and says so
//!   ([`RelayReport::new_lineage`], a warning in the log);
//! - otherwise the sync **refuses** with [`Error::Conflict`] naming both
//!   manifests, and copies nothing, until the origin publishes an anchor
//!   numbered after the destination's newest version. An origin behind the
//!   destination, or empty while the destination is not, is refused the same
//!   way.
//!
//! **Repairs.** After each sync the destination's live window (its newest
//! anchor to its newest version: what a newcomer and a follower read) is
//! audited against the origin: a manifest missing from the window is copied
//! again (its successor's base, same lineage), an object missing or of the
//! wrong size (one listing per object prefix) is copied again, and the
//! objects of a version that a subscriber of the destination reports
//! quarantined (its registration) are measured and the damaged ones copied
//! again — each copy verified against the manifest as always. At a
//! `file://` destination, the staging files of uploads a killed relay left
//! behind (`<key>#<n>`, which no listing shows) are removed on the first
//! sync and after a failed copy.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::{Duration, Instant};

use futures::StreamExt;
use serde::Serialize;

use crate::error::{Error, ErrorKind, Result};
use crate::notify::{Key, Notification, SendPolicy};
use crate::protocol::{
    Commit, Latest, Manifest, ObjectRole, Retention, VersionKind, commit, manifest_key,
    newest_version, read_manifest, versions_after, write_latest,
};
use crate::store::Store;

/// Objects copied at once by default.
pub const OBJECTS_IN_FLIGHT: usize = 4;
/// Parts of a large object read ahead (and uploading) by default.
pub const PARTS_AHEAD: usize = 4;
/// A version whose objects were measured after a subscriber reported it
/// quarantined is measured again only after this long (its registration
/// keeps reporting it until the subscriber's next try).
pub const REVERIFY_AFTER: Duration = Duration::from_secs(600);

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
    /// Set when the destination's history could not be continued from the
    /// origin's (reset, or written by another writer) and the relay started
    /// a new lineage at an origin anchor numbered after everything the
    /// destination holds (see the module documentation).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub new_lineage: Option<NewLineage>,
    /// Versions of the destination's live window whose manifest was missing
    /// and was copied again from the origin.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub repaired_versions: Vec<u64>,
    /// Objects of the destination's live window found missing, of the wrong
    /// size, or damaged (in a version a subscriber reported quarantined),
    /// copied again from the origin: their keys.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub repaired_objects: Vec<String>,
    /// Staging files of interrupted uploads removed at a `file://`
    /// destination.
    #[serde(skip_serializing_if = "is_zero")]
    pub staging_removed: u64,
    /// What retention removed at the destination, when it ran.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub collected: Option<crate::protocol::Collected>,
}

fn is_zero(v: &u64) -> bool {
    *v == 0
}

/// A new lineage started at the destination ([`RelayReport::new_lineage`]).
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct NewLineage {
    /// The origin anchor the destination's new history starts from.
    pub anchor: u64,
    /// The destination's newest version before it (the end of the history
    /// it no longer continues).
    pub after: u64,
    /// Why the destination's history could not be continued.
    pub reason: String,
}

/// What the destination holds under a version number.
enum Held {
    Absent,
    Manifest(Manifest),
    /// A manifest that fails validation (damaged).
    Unreadable,
}

/// How an origin version fits the destination's history.
enum Fit {
    /// Its base (if any) is the destination's: copy it as it is.
    Same(Manifest),
    /// An anchor whose bridges belong to another history than the
    /// destination's: copy it without them (a new lineage), and why.
    NewLineage(Manifest, String),
    /// A delta on another history than the destination's: never copied.
    Break(String),
}

/// Whether `dest` (the destination's manifest of a version) is the commit
/// `origin` (the origin's): the same manifest, or the same anchor copied
/// without its bridges when it started a new lineage.
fn same_commit(origin: &Manifest, dest: &Manifest) -> bool {
    origin == dest
        || (dest.kind == VersionKind::Anchor
            && dest.base_version.is_none()
            && origin.base_version.is_some()
            && without_bridges(origin.clone()) == *dest)
}

/// An anchor without its bridge deltas (an unbridged anchor: nothing before
/// it is needed to read it). Other manifests are returned as they are.
fn without_bridges(mut m: Manifest) -> Manifest {
    if m.kind == VersionKind::Anchor {
        m.base_version = None;
        m.objects.retain(|o| o.role != ObjectRole::Delta);
    }
    m
}

/// A manifest in a message: `versions/….json` (writer, kind, step).
fn describe(m: &Manifest) -> String {
    let step = m.step.map(|s| format!(", step {s}")).unwrap_or_default();
    format!(
        "`{}` (writer {}, {:?}{step})",
        manifest_key(m.version),
        m.writer,
        m.kind
    )
}

/// Mirrors one origin prefix into one destination prefix.
pub struct Relay {
    from: Store,
    to: Store,
    cfg: RelayConfig,
    notifications: tokio::task::JoinSet<usize>,
    /// Destination manifests read or committed by this relay (immutable
    /// once committed), from the destination's newest anchor on.
    known: BTreeMap<u64, Manifest>,
    /// Remove staging leftovers at a `file://` destination at the next sync.
    sweep: bool,
    /// Versions whose objects were measured after a quarantine report, when.
    measured: HashMap<u64, Instant>,
}

impl Relay {
    /// A relay from `from` to `to`.
    pub fn new(from: Store, to: Store, cfg: RelayConfig) -> Relay {
        Relay {
            from,
            to,
            cfg,
            notifications: tokio::task::JoinSet::new(),
            known: BTreeMap::new(),
            sweep: true,
            measured: HashMap::new(),
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
    /// documentation), in order, then audits and repairs the destination's
    /// live window; stops at the first version that fails, leaving the
    /// versions before it committed. A destination whose history the
    /// origin's does not continue, with no origin anchor after it, is an
    /// [`Error::Conflict`] naming both manifests.
    pub async fn sync_once(&mut self) -> Result<RelayReport> {
        // Reap finished notification tasks (they never fail).
        while self.notifications.try_join_next().is_some() {}
        let mut report = RelayReport::default();
        if std::mem::take(&mut self.sweep) {
            report.staging_removed = sweep_staging(self.to.url());
        }
        let held: BTreeSet<u64> = versions_after(&self.to, None).await?.into_iter().collect();
        report.origin = newest_version(&self.from).await?;
        report.destination = held.last().copied();
        let Some(newest) = report.origin else {
            if let Some(d) = report.destination {
                return Err(self.refusal(
                    d,
                    format!(
                        "the origin has no committed version at all, the destination holds up \
                         to version {d} (was the origin wiped?)"
                    ),
                    None,
                ));
            }
            return Ok(report);
        };
        // The destination's newest version, known to be the origin's.
        let mut tip: Option<Manifest> = None;
        let first = match report.destination {
            None => Some(self.origin_anchor(newest).await?),
            Some(d) if newest <= d => {
                let mine = self.dest_manifest(d).await?;
                let theirs = self.origin_manifest(d).await?;
                match (mine, &theirs) {
                    (Held::Manifest(m), Some(o)) if same_commit(o, &m) => tip = Some(m),
                    (mine, theirs) => {
                        return Err(self.refusal(
                            d,
                            lineage_reason(d, theirs.as_ref(), &mine),
                            Some(newest),
                        ));
                    }
                }
                None
            }
            Some(d) => Some(d + 1),
        };
        let mut anchored = false;
        if let Some(mut v) = first {
            while v <= newest {
                match self.relay_version(v, &mut report).await {
                    Ok(Fit::Same(m)) | Ok(Fit::NewLineage(m, _)) => {
                        anchored |= m.kind == VersionKind::Anchor;
                        report.versions.push(v);
                        report.destination = Some(v);
                        self.notify(&m);
                        tip = Some(m);
                        v += 1;
                    }
                    Ok(Fit::Break(why)) => {
                        // A delta on another history: the destination can
                        // only move on at an anchor after all it holds.
                        let held_to = report.destination.unwrap_or_default();
                        let anchor = self.origin_anchor(newest).await?;
                        if anchor <= held_to || anchor <= v {
                            return Err(self.refusal(held_to, why, Some(newest)));
                        }
                        tracing::warn!(
                            destination = held_to,
                            anchor,
                            reason = %why,
                            "the origin's history is not the destination's; starting a new lineage at the origin's anchor"
                        );
                        report.new_lineage = Some(NewLineage {
                            anchor,
                            after: held_to,
                            reason: why,
                        });
                        tip = None;
                        v = anchor;
                    }
                    Err(e) if e.kind() == ErrorKind::Corrupt => {
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
                        tip = None;
                        v = anchor;
                    }
                    Err(e) => return Err(e),
                }
            }
        }
        if anchored && let Some(r) = &self.cfg.retention {
            match crate::protocol::collect_garbage(&self.to, r, false).await {
                Ok(c) => report.collected = Some(c),
                Err(e) => tracing::warn!(error = %e, "retention at the destination failed"),
            }
        }
        if let Some(tip) = tip {
            let mut held = held;
            held.extend(report.versions.iter().copied());
            if let Some(c) = &report.collected {
                held.retain(|v| !c.versions.contains(v));
            }
            if let Err(e) = self.audit(&tip, &held, &mut report).await {
                tracing::warn!(error = %e, "auditing the destination failed; it is audited again at the next sync");
            }
            let from = tip.anchor_version;
            self.known.retain(|&v, _| v >= from);
            self.measured.retain(|&v, _| v >= from);
        }
        Ok(report)
    }

    /// The refusal to join two histories: names what differs (`why`), the
    /// destination's newest version `held` and what to do.
    fn refusal(&self, held: u64, why: String, newest: Option<u64>) -> Error {
        let origin = newest.map_or("none".to_string(), |n| n.to_string());
        tracing::error!(destination = held, origin = ?newest, reason = %why, "refusing to join two histories");
        Error::Conflict(format!(
            "relay from `{}` to `{}`: {why}. The origin's history is not the one the destination \
             mirrors (the origin was reset or rewritten, or another writer wrote the \
             destination); its versions are not copied onto the destination's, whose \
             subscribers would refuse them. The relay starts a new lineage \
             by itself once the origin's newest anchor is numbered after {held} (the origin's \
             newest version is {origin}); to mirror the origin's history now, relay into an \
             empty prefix, or empty this one",
            self.from.url(),
            self.to.url()
        ))
    }

    /// The anchor of the origin's version `newest`.
    async fn origin_anchor(&self, newest: u64) -> Result<u64> {
        let m = read_manifest(&self.from, newest).await?.ok_or_else(|| {
            Error::NotFound(format!(
                "version {newest} vanished from the origin `{}` while being read",
                self.from.url()
            ))
        })?;
        Ok(m.anchor_version)
    }

    /// The origin's manifest of `v`; `None` when it is missing or does not
    /// validate (neither proves anything about the destination's history).
    async fn origin_manifest(&self, v: u64) -> Result<Option<Manifest>> {
        match read_manifest(&self.from, v).await {
            Err(e) if e.kind() == ErrorKind::Corrupt => Ok(None),
            other => other,
        }
    }

    /// The destination's manifest of `v` (remembered once read).
    async fn dest_manifest(&mut self, v: u64) -> Result<Held> {
        if let Some(m) = self.known.get(&v) {
            return Ok(Held::Manifest(m.clone()));
        }
        match read_manifest(&self.to, v).await {
            Ok(Some(m)) => {
                self.known.insert(v, m.clone());
                Ok(Held::Manifest(m))
            }
            Ok(None) => Ok(Held::Absent),
            Err(e) if e.kind() == ErrorKind::Corrupt => Ok(Held::Unreadable),
            Err(e) => Err(e),
        }
    }

    /// How the origin's `m` fits the destination's history (see [`Fit`]).
    async fn fit(&mut self, m: Manifest) -> Result<Fit> {
        // An unbridged anchor needs nothing before it; whether it continues
        // the destination's history is still said.
        let Some(b) = m.base_version.or(m.version.checked_sub(1)) else {
            return Ok(Fit::Same(m));
        };
        let mine = self.dest_manifest(b).await?;
        if matches!(mine, Held::Absent) {
            // Nothing at the destination holds the base: an anchor's
            // bridges are of no use there, and no harm; a delta cannot be
            // read.
            return Ok(match m.kind {
                VersionKind::Anchor => Fit::Same(m),
                VersionKind::Delta => Fit::Break(format!(
                    "the origin's version {} is a delta on version {b}, which the destination \
                     does not hold",
                    m.version
                )),
            });
        }
        let theirs = self.origin_manifest(b).await?;
        if let (Held::Manifest(mine), Some(theirs)) = (&mine, &theirs)
            && same_commit(theirs, mine)
        {
            return Ok(Fit::Same(m));
        }
        let why = lineage_reason(b, theirs.as_ref(), &mine);
        Ok(match m.kind {
            // Without the bridges of the other history (if it has any).
            VersionKind::Anchor => Fit::NewLineage(without_bridges(m), why),
            VersionKind::Delta => Fit::Break(why),
        })
    }

    /// Copies version `v` and commits it at the destination, if it fits
    /// the destination's history.
    async fn relay_version(&mut self, v: u64, report: &mut RelayReport) -> Result<Fit> {
        let Some(m) = read_manifest(&self.from, v).await? else {
            // Collected by retention at the origin (the destination fell
            // behind its oldest anchor), or the origin was reset.
            return Ok(Fit::Break(format!(
                "the origin no longer has version {v}, which follows the destination's newest"
            )));
        };
        let fit = self.fit(m).await?;
        let m = match &fit {
            Fit::Same(m) => m,
            Fit::NewLineage(m, why) => {
                let after = report.destination.unwrap_or_default();
                tracing::warn!(
                    anchor = v,
                    destination = after,
                    reason = %why,
                    "the origin's history is not the destination's; starting a new lineage at this anchor, without its bridges"
                );
                report.new_lineage = Some(NewLineage {
                    anchor: v,
                    after,
                    reason: why.clone(),
                });
                m
            }
            Fit::Break(_) => return Ok(fit),
        };
        self.copy_objects(m, report).await?;
        self.commit(m, true).await?;
        self.known.insert(v, m.clone());
        tracing::info!(
            version = v,
            kind = ?m.kind,
            from = self.from.url(),
            to = self.to.url(),
            "relayed"
        );
        Ok(fit)
    }

    /// Audits the destination's live window — from the newest anchor of
    /// `tip` (its newest version, the origin's) to `tip` — and repairs it
    /// from the origin: manifests missing (`held`: the destination's
    /// versions), objects missing or of the wrong size, and objects of
    /// versions a subscriber reported quarantined that do not measure right.
    async fn audit(
        &mut self,
        tip: &Manifest,
        held: &BTreeSet<u64>,
        report: &mut RelayReport,
    ) -> Result<()> {
        let from = tip.anchor_version;
        let mut window = vec![tip.clone()];
        let mut upper = tip.clone();
        for v in (from..tip.version).rev() {
            if held.contains(&v) {
                match self.dest_manifest(v).await? {
                    Held::Manifest(m) => {
                        upper = m.clone();
                        window.push(m);
                        continue;
                    }
                    // A damaged manifest is not overwritten (its subscribers
                    // refuse it; removing it lets the relay copy it again).
                    _ => break,
                }
            }
            // Missing: the origin's `v` is the base of the origin's `v + 1`,
            // which the destination holds as it is.
            if upper.base_version != Some(v) {
                break;
            }
            let Some(m) = self.origin_manifest(v).await? else {
                tracing::warn!(
                    version = v,
                    "the destination lacks a version of its live window and the origin no longer has it"
                );
                break;
            };
            self.copy_objects(&m, report).await?;
            self.commit(&m, false).await?;
            tracing::warn!(
                version = v,
                "repaired: the destination lacked the manifest of a version of its live window; copied again from the origin"
            );
            report.repaired_versions.insert(0, v);
            self.known.insert(v, m.clone());
            upper = m.clone();
            window.push(m);
        }
        let mut sizes: HashMap<String, u64> = HashMap::new();
        for prefix in crate::protocol::layout::OBJECT_PREFIXES {
            let after = format!("{prefix}/{from:020}");
            for l in self.to.list_after(prefix, &after).await? {
                sizes.insert(l.key, l.size);
            }
        }
        let reported = self.reported_quarantined(from, tip.version).await;
        window.sort_by_key(|m| m.version);
        for m in &window {
            let measure = reported.contains(&m.version);
            for o in &m.objects {
                let damaged = if sizes.get(&o.key) != Some(&o.size) {
                    true
                } else if measure {
                    self.to.measure(&o.key).await? != Some((o.size, o.blake3.clone()))
                } else {
                    false
                };
                if !damaged {
                    continue;
                }
                match self
                    .from
                    .copy_verified(&self.to, &o.key, (o.size, &o.blake3), self.cfg.parts_ahead)
                    .await
                {
                    Ok(()) => {
                        tracing::warn!(
                            version = m.version,
                            key = o.key,
                            "repaired: a destination object was missing or damaged; copied again from the origin"
                        );
                        report.repaired_objects.push(o.key.clone());
                    }
                    Err(e) => {
                        self.sweep = true;
                        tracing::error!(
                            version = m.version,
                            key = o.key,
                            error = %e,
                            "a destination object is missing or damaged and cannot be copied again from the origin"
                        );
                    }
                }
            }
            if measure {
                self.measured.insert(m.version, Instant::now());
            }
        }
        Ok(())
    }

    /// Versions in `from..=to` that a fresh registration at the destination
    /// reports quarantined, and that were not measured recently.
    async fn reported_quarantined(&self, from: u64, to: u64) -> BTreeSet<u64> {
        let regs = match crate::protocol::registrations(&self.to).await {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(error = %e, "cannot read the destination's registrations");
                return BTreeSet::new();
            }
        };
        let max_age = crate::notify::registration_horizon(self.cfg.retention.as_ref());
        let now = crate::protocol::registry::unix_now();
        regs.iter()
            .filter(|r| now.saturating_sub(r.updated_at) <= max_age)
            .flat_map(|r| r.quarantined.iter().copied())
            .filter(|v| (from..=to).contains(v))
            .filter(|v| {
                self.measured
                    .get(v)
                    .is_none_or(|t| t.elapsed() >= REVERIFY_AFTER)
            })
            .collect()
    }

    /// Copies the objects of `m`, [`RelayConfig::objects_in_flight`] at a
    /// time, skipping those already in place.
    async fn copy_objects(&mut self, m: &Manifest, report: &mut RelayReport) -> Result<()> {
        let ahead = self.cfg.parts_ahead;
        let mut copies = futures::stream::iter(m.objects.clone())
            .map(|o| copy_one(self.from.clone(), self.to.clone(), o, ahead))
            .buffer_unordered(self.cfg.objects_in_flight.max(1));
        while let Some(r) = copies.next().await {
            let (copied, size) = match r {
                Ok(r) => r,
                Err(e) => {
                    tracing::error!(version = m.version, error = %e, "relaying the version failed; nothing of it is committed");
                    drop(copies);
                    self.sweep = true;
                    return Err(e);
                }
            };
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

    /// Commits `m` at the destination, then (`hint`) its `latest.json`.
    async fn commit(&self, m: &Manifest, hint: bool) -> Result<()> {
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
        if !hint {
            return Ok(());
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

/// Why the destination's version `v` (`mine`) is not the origin's
/// (`theirs`), in words naming both manifests.
fn lineage_reason(v: u64, theirs: Option<&Manifest>, mine: &Held) -> String {
    let origin = theirs.map_or_else(
        || format!("has no (readable) `{}`", manifest_key(v)),
        |m| format!("has {}", describe(m)),
    );
    let dest = match mine {
        Held::Manifest(m) => format!("has {}", describe(m)),
        Held::Absent => format!("has no `{}`", manifest_key(v)),
        Held::Unreadable => format!("has a `{}` that does not validate", manifest_key(v)),
    };
    format!("at version {v} the origin {origin}, the destination {dest}")
}

/// Removes the staging files that interrupted uploads left at a `file://`
/// destination: object_store writes each object to `<file>#<n>` and renames
/// it into place, so a process killed mid-upload (or a copy it abandoned)
/// leaves that file, which no listing shows and nothing else removes. Only
/// the relay's own prefixes are swept (`anchors/`, `deltas/`, `files/`,
/// `versions/`, `latest.json`): a destination is written by one relay, and
/// the sweep runs while none of its uploads is in flight. Other stores:
/// nothing (incomplete S3 multipart uploads are a lifecycle rule's job).
/// Returns how many were removed.
fn sweep_staging(url: &str) -> u64 {
    let Some(root) = url::Url::parse(url)
        .ok()
        .filter(|u| u.scheme() == "file")
        .and_then(|u| u.to_file_path().ok())
    else {
        return 0;
    };
    let mut removed = 0;
    let mut dirs: Vec<(std::path::PathBuf, usize)> = crate::protocol::layout::OBJECT_PREFIXES
        .iter()
        .chain(&[crate::protocol::layout::VERSIONS_PREFIX])
        .map(|p| (root.join(p), 0))
        .collect();
    remove_staging_in(&root, &mut removed, None);
    while let Some((dir, depth)) = dirs.pop() {
        // Object names are at most a few components deep; links are not
        // followed.
        if depth > 64 {
            continue;
        }
        remove_staging_in(&dir, &mut removed, Some((&mut dirs, depth)));
    }
    if removed > 0 {
        tracing::info!(
            removed,
            "removed staging files of interrupted uploads at the destination"
        );
    }
    removed
}

/// Removes the staging files directly in `dir`; queues its subdirectories
/// when `subdirs` is given.
fn remove_staging_in(
    dir: &std::path::Path,
    removed: &mut u64,
    mut subdirs: Option<(&mut Vec<(std::path::PathBuf, usize)>, usize)>,
) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let Ok(t) = e.file_type() else { continue };
        if t.is_dir() {
            if let Some((queue, depth)) = subdirs.as_mut() {
                queue.push((e.path(), *depth + 1));
            }
            continue;
        }
        if !t.is_file() || !is_staging_name(&e.file_name().to_string_lossy()) {
            continue;
        }
        match std::fs::remove_file(e.path()) {
            Ok(()) => *removed += 1,
            Err(err) => {
                tracing::warn!(path = %e.path().display(), error = %err, "cannot remove a staging file")
            }
        }
    }
}

/// Whether a file name is object_store's staging name for an upload in
/// progress (`<name>#<digits>`, a name no object can have).
fn is_staging_name(name: &str) -> bool {
    name.rsplit_once('#')
        .is_some_and(|(_, n)| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn staging_names_are_recognized() {
        for yes in ["model.safetensors#1", "latest.json#12", "a#b#3"] {
            assert!(is_staging_name(yes), "{yes}");
        }
        for no in ["model.safetensors", "a#b", "a#", "a#1b", "config.json"] {
            assert!(!is_staging_name(no), "{no}");
        }
    }
}
