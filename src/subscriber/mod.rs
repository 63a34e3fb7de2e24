//! The subscriber: follows the bucket, verifies every version, and hands it
//! to a sink — an output directory engines load, or tensors in memory.
//!
//! # Parts
//!
//! | part | module | does |
//! |---|---|---|
//! | version source | [`source`] | learns the newest committed version: a conditional GET of `latest.json` per poll, a `versions/` listing after the held version for certainty, early wake-ups on notifications, jittered intervals |
//! | planner | [`plan`] | from the held version and the target's manifest: replay the versions in between, or start from the anchor (pure [`plan::choose`], manifests read by [`plan::plan`]) |
//! | fetcher | [`fetch`] | reads the store (counting requests); small objects into memory, large ones as concurrent ranged GETs into a file; every object checked against its manifest entry (size, BLAKE3) |
//! | sink | [`sink`], [`dir`] | applies verified objects: [`DirSink`] (an output directory of A/B slots patched in place) or [`MemorySink`] (tensors in memory, the caller's own buffers included) |
//! | daemon | [`daemon`] | the loop: source → plan → fetch → sink → hooks → status and registration; `subscribe --once` is one iteration of it |
//!
//! [`Subscriber`] composes a [`Fetcher`], a [`VersionSource`] and any
//! [`Sink`]: [`Subscriber::catch_up`] is one catch-up. A relay or a Python
//! binding is another composition (another sink, or the fetcher feeding
//! something else), not another loop.
//!
//! # Catching up
//!
//! From the held version `a` to the newest `b`: replay the deltas after `a`
//! (across bridged anchors) when they add up to less than `b`'s anchor plus
//! the deltas after it, otherwise start from that anchor. Every object's size
//! and BLAKE3 are checked against the manifest, every anchor's digests
//! against its header, every delta against the exact base it was made from
//! (digests). A replay that fails verification is repaired by starting again
//! from the anchor; a failure there is an error, and the sink's visible state
//! stays as it was. Objects of the next versions download while the current
//! one is applied (a bounded prefetch, [`PREFETCH_BYTES`]).
//!
//! # The output directory
//!
//! ```text
//! DIR/current -> slots/<a|b|...>       symlink, switched atomically (rename of a new symlink)
//! DIR/slots/<name>/<checkpoint files>  one version per slot, plain safetensors files
//! DIR/.state.json                      per slot: version, dirty flag, per-file layout, digests, BLAKE3s
//! DIR/.journal/<version>...            verified delta and file objects of the last versions
//! ```
//!
//! The slot `current` points to is never written. A version is produced in
//! the oldest other slot, patched in place: marked dirty (state fsynced),
//! brought forward by the journal's objects of the versions it missed
//! (nothing downloaded), the new deltas applied through a shared memory map,
//! files the version no longer lists removed, everything flushed, the slot
//! recorded clean at its version (state fsynced), and only then `current`
//! switched. No version copies the model: anonymous memory follows the
//! changes, and the bytes written are the changed elements (the kernel writes
//! back whole pages). See [`dir`] for the details.
//!
//! **Crash safety.** Every visible name switches by a rename, and data is
//! durable before the name that exposes it: slot files (msync, fsync) before
//! the state records the slot clean, the state before `current` switches. A
//! crash at any point leaves `current` on a complete, recorded version; a slot
//! recorded dirty is never trusted (it is rebuilt from the current slot or an
//! anchor); a crash between the state and the switch is finished at the next
//! start. At start the current slot is verified in full (every tensor digest,
//! every file's BLAKE3) — `--once` does this on every run, so damage to an idle
//! output is found and repaired from the anchor into another slot.
//!
//! **Engines.** With N slots (`--slots N`, default 2), the files of a version
//! stay untouched until N−1 newer versions have been switched in. Hooks run
//! after each switch and before the next update starts, so an engine that
//! reloads within its hook is safe with two slots; one that keeps reading the
//! previous version's files for longer needs more.

pub mod daemon;
pub mod dir;
pub mod fetch;
pub mod plan;
pub mod sink;
pub mod source;
pub mod status;
pub mod trl;

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::path::Path;

use bytes::Bytes;
use serde::Serialize;

use crate::error::{Error, ErrorKind, Result};
use crate::protocol::{Manifest, ObjectEntry, ObjectRole};
use crate::store::Store;

pub use daemon::{Daemon, DaemonConfig, REGISTRATION_REFRESH, once, run};
pub use dir::DirSink;
pub use fetch::Fetcher;
pub use plan::Plan;
pub use sink::{AnchorDest, AnchorObject, MemorySink, Produced, Sink, decode_anchor};
pub use source::{Seen, VersionSource};

/// Bytes of delta and file objects downloaded ahead of the one being applied.
pub const PREFETCH_BYTES: u64 = 64 << 20;
/// Objects downloaded ahead of the one being applied.
const PREFETCH_OBJECTS: usize = 8;

/// What a catch-up did.
#[derive(Clone, Debug, Default, Serialize)]
pub struct CaughtUp {
    /// The version now held.
    pub version: u64,
    /// The verified version held before (absent on a first run, or when the
    /// held one was found damaged).
    pub previous: Option<u64>,
    /// Bytes of objects downloaded.
    pub downloaded: u64,
    /// Versions applied as deltas from the bucket.
    pub deltas_applied: u64,
    /// Whether it started from an anchor.
    pub from_anchor: bool,
    /// Repairs: replays that failed verification and were redone from an
    /// anchor, and held output found damaged.
    pub repairs: u64,
    /// Tensors changed since the previous version, sorted (empty after an
    /// anchor: everything may have changed).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub changed_tensors: Vec<String>,
    /// Bytes written into the output: anchors, non-tensor files, changed
    /// elements patched in place, copies made to rebuild a slot.
    pub written_bytes: u64,
    /// Bytes of journal objects applied to bring the slot forward.
    pub journal_bytes: u64,
    /// Bytes copied from the current slot to rebuild another (no reflink).
    pub cloned_bytes: u64,
    /// The output slot now current (directory sinks).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub slot: Option<String>,
    /// Store requests made (listings, manifests, hints, object reads and parts).
    pub requests: u64,
    /// Versions this subscriber could not verify and does not serve (newest
    /// first); retried with backoff, skipped meanwhile.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub quarantined: Vec<Quarantined>,
}

/// A version a subscriber could not verify (corrupt or missing objects, a
/// manifest it cannot read): it keeps serving its last verified version, or
/// the newest older one it can verify, and tries this one again later.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct Quarantined {
    /// The version.
    pub version: u64,
    /// Why it was refused.
    pub error: String,
    /// Failed attempts so far.
    pub attempts: u32,
}

/// How many versions one catch-up tries, newest first, before giving up
/// for this iteration (the next iterations go on below the quarantined ones).
const FALLBACK_TARGETS: usize = 3;

/// First wait before a quarantined version is tried again; doubles per
/// failed attempt up to [`QUARANTINE_MAX`].
const QUARANTINE_FIRST: std::time::Duration = std::time::Duration::from_secs(30);
/// Longest wait before a quarantined version is tried again.
const QUARANTINE_MAX: std::time::Duration = std::time::Duration::from_secs(3600);

impl CaughtUp {
    /// Nothing new: the sink stays at `version`.
    fn unchanged(version: u64, requests: u64) -> CaughtUp {
        CaughtUp {
            version,
            previous: Some(version),
            requests,
            ..CaughtUp::default()
        }
    }
}

/// Whether a failed replay should be redone from an anchor: yes for what the
/// bucket's data caused (corruption, a wrong base, a missing object), no for
/// what an anchor would not fix (the store unreachable, configuration, local
/// I/O).
fn repairable(e: &Error) -> bool {
    !matches!(
        e.kind(),
        ErrorKind::Unavailable | ErrorKind::Config | ErrorKind::Io
    )
}

/// Downloads the objects of a replay ahead of their use, in order, with a
/// bounded number of bytes in flight (each download is a task of its own, so
/// it progresses while the sink applies).
struct Prefetch {
    fetcher: Fetcher,
    pending: VecDeque<ObjectEntry>,
    running: VecDeque<(u64, tokio::task::JoinHandle<Result<Bytes>>)>,
}

impl Prefetch {
    fn new(fetcher: Fetcher, objects: Vec<ObjectEntry>) -> Prefetch {
        Prefetch {
            fetcher,
            pending: objects.into(),
            running: VecDeque::new(),
        }
    }

    fn fill(&mut self) {
        let mut ahead: u64 = self.running.iter().map(|r| r.0).sum();
        while let Some(o) = self.pending.front() {
            let full = ahead + o.size > PREFETCH_BYTES || self.running.len() >= PREFETCH_OBJECTS;
            if full && !self.running.is_empty() {
                break;
            }
            let o = self.pending.pop_front().expect("front exists");
            ahead += o.size;
            let f = self.fetcher.clone();
            let size = o.size;
            self.running
                .push_back((size, tokio::spawn(async move { f.bytes(&o).await })));
        }
    }

    /// The next object's verified bytes.
    async fn next(&mut self) -> Result<Bytes> {
        self.fill();
        let (_, task) = self
            .running
            .pop_front()
            .ok_or_else(|| Error::BadRequest("prefetch queue is empty".into()))?;
        self.fill();
        task.await
            .map_err(|e| Error::io("downloading an object", std::io::Error::other(e)))?
    }
}

impl Drop for Prefetch {
    fn drop(&mut self) {
        for (_, t) in &self.running {
            t.abort();
        }
    }
}

/// A subscriber: a fetcher, a version source and a sink, composed.
#[derive(Debug)]
pub struct Subscriber<S: Sink> {
    /// Reads the store.
    pub fetcher: Fetcher,
    /// Learns the newest version.
    pub source: VersionSource,
    /// Receives verified versions.
    pub sink: S,
    repairs_found: u64,
    /// Versions that failed verification: (entry, when to try it again).
    quarantine: BTreeMap<u64, (Quarantined, std::time::Instant)>,
}

impl<S: Sink> Subscriber<S> {
    /// Composes the parts.
    pub fn new(fetcher: Fetcher, source: VersionSource, sink: S) -> Subscriber<S> {
        Subscriber {
            fetcher,
            source,
            sink,
            repairs_found: 0,
            quarantine: BTreeMap::new(),
        }
    }

    /// Counts a repair found outside a catch-up (held output found damaged
    /// when the sink was opened); reported by the next catch-up.
    pub fn note_repair(&mut self) {
        self.repairs_found += 1;
    }

    /// One catch-up to the newest committed version. `thorough` makes the
    /// source list the bucket even if the hint did not move (see [`source`]).
    /// Returns `None` when the bucket has no version yet.
    ///
    /// A version that cannot be verified (what the bucket holds is corrupt,
    /// missing or unreadable — not the store being unreachable) is
    /// quarantined: the subscriber keeps its verified version, or reaches the
    /// newest older version it can verify, reports the bad one in
    /// [`CaughtUp::quarantined`], and tries it again after a backoff (30 s
    /// doubling to an hour). A later good version or anchor moves it on.
    pub async fn catch_up(&mut self, thorough: bool) -> Result<Option<CaughtUp>> {
        let requests = self.fetcher.requests();
        let held = self.sink.held();
        let newest = match self.source.check(&self.fetcher, held, thorough).await? {
            source::Seen::Empty => return Ok(None),
            source::Seen::Newest(t) => t,
            source::Seen::Same => {
                // Nothing new; a quarantined version may be due for a retry.
                let now = std::time::Instant::now();
                let due = self
                    .quarantine
                    .iter()
                    .rev()
                    .find(|(v, (_, at))| held.is_none_or(|h| **v > h) && *at <= now);
                match (due, held) {
                    (Some((&v, _)), _) => self.quarantine.keys().next_back().copied().unwrap_or(v),
                    (None, Some(h)) => {
                        let mut c = CaughtUp::unchanged(h, self.fetcher.requests() - requests);
                        c.quarantined = self.quarantined();
                        return Ok(Some(c));
                    }
                    (None, None) => return Ok(None),
                }
            }
        };
        let now = std::time::Instant::now();
        let mut last_error = None;
        let mut tried = 0;
        let mut candidate = Some(newest);
        while let Some(t) = candidate {
            // Down to the held version; below it only when the bucket's
            // newest is older (the held version vanished from the bucket).
            if held.is_some_and(|h| t == h || (t < h && t != newest)) {
                break;
            }
            let due = self.quarantine.get(&t).is_none_or(|(_, at)| *at <= now);
            if due {
                if tried == FALLBACK_TARGETS {
                    break;
                }
                tried += 1;
                match self.reach(held, t, requests).await {
                    Ok(mut c) => {
                        self.quarantine.remove(&t);
                        // Versions at or below the one reached are moot.
                        self.quarantine.retain(|v, _| *v > t);
                        c.quarantined = self.quarantined();
                        return Ok(Some(c));
                    }
                    Err(e) if repairable(&e) => {
                        self.quarantine_version(t, &e);
                        last_error = Some(e);
                    }
                    Err(e) => return Err(e),
                }
            }
            candidate = t.checked_sub(1);
        }
        match held {
            Some(h) => {
                let mut c = CaughtUp::unchanged(h, self.fetcher.requests() - requests);
                c.quarantined = self.quarantined();
                Ok(Some(c))
            }
            None => Err(last_error.unwrap_or_else(|| {
                Error::NotFound(format!(
                    "no version of `{}` could be verified yet (quarantined: {:?}); retrying",
                    self.fetcher.store().url(),
                    self.quarantine.keys().collect::<Vec<_>>()
                ))
            })),
        }
    }

    /// The quarantined versions, newest first.
    pub fn quarantined(&self) -> Vec<Quarantined> {
        self.quarantine
            .values()
            .rev()
            .map(|(q, _)| q.clone())
            .collect()
    }

    fn quarantine_version(&mut self, version: u64, e: &Error) {
        let attempts = self.quarantine.get(&version).map_or(0, |(q, _)| q.attempts) + 1;
        let wait = QUARANTINE_FIRST
            .saturating_mul(1 << (attempts - 1).min(16))
            .min(QUARANTINE_MAX);
        tracing::warn!(version, attempts, retry_in = ?wait, error = %e, "version quarantined: it cannot be verified");
        self.quarantine.insert(
            version,
            (
                Quarantined {
                    version,
                    error: e.to_string(),
                    attempts,
                },
                std::time::Instant::now() + wait,
            ),
        );
    }

    /// Brings the sink to exactly version `target` (committed in the bucket),
    /// newer or older than what it holds: a replay when that is cheaper,
    /// otherwise from the anchor, verified and repaired as
    /// [`Subscriber::catch_up`] does. For callers that choose the version
    /// themselves (a Python `Update.save_to`).
    pub async fn catch_up_to(&mut self, target: u64) -> Result<CaughtUp> {
        let requests = self.fetcher.requests();
        let held = self.sink.held();
        if held == Some(target) {
            return Ok(CaughtUp::unchanged(target, 0));
        }
        self.reach(held, target, requests).await
    }

    /// Brings the sink from `held` to `target` (replay, or bootstrap from
    /// the anchor; a replay that fails verification is redone from it).
    async fn reach(&mut self, held: Option<u64>, target: u64, requests: u64) -> Result<CaughtUp> {
        let (plan, mut chain) = plan::plan(&self.fetcher, held, target).await?;
        let mut out = CaughtUp {
            version: target,
            previous: held,
            repairs: std::mem::take(&mut self.repairs_found),
            ..CaughtUp::default()
        };
        let mut produced = None;
        if let Plan::Replay(versions) = &plan {
            match self.execute(held, None, versions, &chain, &mut out).await {
                Ok(p) => produced = Some(p),
                Err(e) if repairable(&e) => {
                    tracing::warn!(error = %e, "replay failed; repairing from the anchor");
                    out.repairs += 1;
                }
                Err(e) => return Err(e),
            }
        }
        let produced = match produced {
            Some(p) => p,
            None => {
                let anchor = chain[&target].anchor_version;
                let boot = Plan::Bootstrap {
                    anchor,
                    replay: (anchor + 1..=target).collect(),
                };
                plan::complete(&self.fetcher, &boot, &mut chain).await?;
                let replay: Vec<u64> = (anchor + 1..=target).collect();
                out.from_anchor = true;
                out.deltas_applied = 0;
                self.execute(None, Some(anchor), &replay, &chain, &mut out)
                    .await?
            }
        };
        if out.from_anchor {
            out.changed_tensors.clear();
        }
        out.written_bytes = produced.written_bytes;
        out.journal_bytes = produced.journal_bytes;
        out.cloned_bytes = produced.cloned_bytes;
        out.slot = produced.slot;
        out.requests = self.fetcher.requests() - requests;
        Ok(out)
    }

    /// Runs one update through the sink: begin, objects, commit (abort on
    /// any failure).
    async fn execute(
        &mut self,
        base: Option<u64>,
        anchor: Option<u64>,
        replay: &[u64],
        chain: &BTreeMap<u64, Manifest>,
        out: &mut CaughtUp,
    ) -> Result<Produced> {
        let fed = match self.sink.begin(base) {
            Ok(()) => self.feed(anchor, replay, chain, out).await,
            Err(e) => Err(e),
        };
        match fed.and_then(|()| self.sink.commit()) {
            Ok(p) => Ok(p),
            Err(e) => {
                self.sink.abort();
                Err(e)
            }
        }
    }

    async fn feed(
        &mut self,
        anchor: Option<u64>,
        replay: &[u64],
        chain: &BTreeMap<u64, Manifest>,
        out: &mut CaughtUp,
    ) -> Result<()> {
        if let Some(a) = anchor {
            let m = &chain[&a];
            for o in m.bootstrap_objects() {
                out.downloaded += o.size;
                match o.role {
                    ObjectRole::Anchor => {
                        let object = match self.sink.anchor_dest(&o.name)? {
                            AnchorDest::Memory => {
                                AnchorObject::Bytes(self.fetcher.bytes(o).await?.to_vec())
                            }
                            AnchorDest::File(p) => {
                                self.fetcher.to_file(o, &p).await?;
                                AnchorObject::File(p)
                            }
                        };
                        self.sink.anchor(&o.name, object)?;
                    }
                    _ => {
                        let body = self.fetcher.bytes(o).await?;
                        self.sink.file(a, &o.name, &body)?;
                    }
                }
            }
            self.sink.version_done(m)?;
        }
        let objects = replay
            .iter()
            .flat_map(|v| chain[v].replay_objects().cloned())
            .collect();
        let mut prefetch = Prefetch::new(self.fetcher.clone(), objects);
        let mut changed = BTreeSet::new();
        for v in replay {
            let m = &chain[v];
            if !m.replays_from_previous() {
                return Err(Error::metadata(
                    "manifest",
                    format!("version {v} cannot be replayed into (an anchor without bridges)"),
                ));
            }
            for o in m.replay_objects() {
                let body = prefetch.next().await?;
                out.downloaded += o.size;
                if o.role == ObjectRole::Delta {
                    let report = self.sink.delta(*v, &o.name, &body)?;
                    changed.extend(report.changed_tensors);
                } else {
                    self.sink.file(*v, &o.name, &body)?;
                }
            }
            self.sink.version_done(m)?;
            out.deltas_applied += 1;
        }
        out.changed_tensors = changed.into_iter().collect();
        Ok(())
    }
}

/// Catches the output directory `out` up to the newest committed version of
/// `store`: one iteration of the daemon with default settings (two slots, no
/// hooks), the current slot verified first. Returns `None` when the bucket
/// has no version yet.
pub async fn catch_up(store: &Store, out: &Path) -> Result<Option<CaughtUp>> {
    Ok(once(store, &DaemonConfig::new(out)).await?.map(|(c, _)| c))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::generator::{Generator, GeneratorConfig};
    use crate::publisher::{Checkpoint, PublishOptions, Publisher, PublisherConfig};

    #[tokio::test]
    async fn catch_up_to_reaches_the_version_asked_for() {
        let store = Store::open("memory://").unwrap();
        let dir = tempfile::tempdir().unwrap();
        let mut publisher = Publisher::open(
            store.clone(),
            PublisherConfig::new(dir.path().join("state")),
        )
        .await
        .unwrap();
        let mut g = Generator::new(GeneratorConfig::tiny(5));
        let mut truth = Vec::new();
        for v in 0..3u64 {
            if v > 0 {
                g.step();
            }
            truth.push(g.snapshot());
            let cp = Checkpoint::from_sets(
                BTreeMap::from([("model.safetensors".into(), g.snapshot_without_digests())]),
                BTreeMap::new(),
            )
            .unwrap();
            let p = publisher.publish(cp, &PublishOptions::default()).await;
            assert_eq!(p.unwrap().version, v);
        }
        let mut sub = Subscriber::new(
            Fetcher::new(store),
            VersionSource::new(std::time::Duration::from_secs(1), 0.0),
            MemorySink::new(),
        );
        let held = |sub: &Subscriber<MemorySink>| sub.sink.tensors()["model.safetensors"].digest();
        let c = sub.catch_up_to(1).await.unwrap();
        assert!(c.from_anchor);
        assert_eq!((c.version, held(&sub)), (1, truth[1].digest()));
        let c = sub.catch_up_to(2).await.unwrap();
        assert_eq!((c.version, c.deltas_applied, c.from_anchor), (2, 1, false));
        assert_eq!(held(&sub), truth[2].digest());
        // Back to an older version: from its anchor.
        let c = sub.catch_up_to(0).await.unwrap();
        assert_eq!((c.version, c.from_anchor), (0, true));
        assert_eq!(held(&sub), truth[0].digest());
        assert_eq!(sub.catch_up_to(0).await.unwrap().requests, 0);
        assert!(
            sub.catch_up_to(9).await.is_err(),
            "a version never committed"
        );
        let (version, tensors, _) = sub.sink.into_parts();
        assert_eq!(version, Some(0));
        assert_eq!(tensors["model.safetensors"].digest(), truth[0].digest());
    }
}
