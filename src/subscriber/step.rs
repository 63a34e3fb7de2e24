//! The subscriber's one loop, as steps: [`Subscriber::next_update`] (which
//! version to reach, and how), [`Subscriber::stage`] (download, verify and
//! hand the objects to the sink, nothing visible yet), [`Subscriber::commit`]
//! (make it visible), with the quarantine and repair rules in between.
//! [`Subscriber::catch_up`] is the three in a row, falling back to older
//! versions when the newest cannot be verified; the daemon, `subscribe
//! --once`, the Python binding and the TRL follower all compose these steps
//! over their own [`Sink`].
//!
//! # Repair and quarantine
//!
//! A replay that fails verification while it is staged (corruption, a wrong
//! base, a missing object) is redone from the target's anchor in the same
//! step. A version that cannot be verified even from its anchor is
//! *quarantined*: skipped, reported, and tried again after 30 s doubling to
//! an hour, so one bad version never stalls a fleet. A commit that fails
//! verification (a sink over tensors the caller owns finds an element that
//! does not hold its base) makes the next update start from an anchor.
//! Unavailability, configuration and local I/O errors are neither: an
//! anchor would not fix them, and the next poll retries.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::{Duration, Instant};

use bytes::Bytes;
use serde::Serialize;
use tokio_util::task::AbortOnDropHandle;

use crate::error::{Error, ErrorKind, Result};
use crate::protocol::{Manifest, ObjectEntry, ObjectRole};

use super::fetch::Fetcher;
use super::plan::{self, Plan};
use super::sink::{AnchorDest, AnchorObject, Produced, Sink};
use super::source::{Seen, VersionSource};
use super::trl::{self, TrlLimits};
use super::update::{Log, Ready, StepOptions, Update};

/// Bytes of delta and file objects downloaded ahead of the one being applied.
pub const PREFETCH_BYTES: u64 = 64 << 20;
/// Objects downloaded ahead of the one being applied.
const PREFETCH_OBJECTS: usize = 8;
/// Bootstrap objects downloading at once while another is decoded.
const ANCHOR_DOWNLOADS: usize = 2;
/// Bytes of bootstrap objects downloading at once (or one object, if larger).
const ANCHOR_AHEAD_BYTES: u64 = 1 << 30;

/// How many versions one catch-up tries, newest first, before giving up
/// for this iteration (the next iterations go on below the quarantined ones).
const FALLBACK_TARGETS: usize = 3;

/// First wait before a quarantined version is tried again; doubles per
/// failed attempt up to [`QUARANTINE_MAX`].
const QUARANTINE_FIRST: Duration = Duration::from_secs(30);
/// Longest wait before a quarantined version is tried again.
const QUARANTINE_MAX: Duration = Duration::from_secs(3600);

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
    /// Tensors changed since the previous version, sorted (after an anchor,
    /// every tensor: any may have changed).
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
    /// Some object carried no weightcast digests (a TRL bucket's own):
    /// checked structurally only (names, dtypes, shapes, indices, steps).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub structural_only: bool,
    /// Versions this subscriber could not verify and does not serve (newest
    /// first); retried with backoff, skipped meanwhile.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub quarantined: Vec<Quarantined>,
    /// Where the time went, seconds: waiting on the store (the listing and
    /// manifests, and object downloads the sink did not overlap).
    pub fetch_s: f64,
    /// Decoding, verifying and writing the version where nothing reads it
    /// yet (the standby slot; the caller's staging), while the engine still
    /// serves the previous one.
    pub prepare_s: f64,
    /// The engine's pause (its hooks: pause answered to resume answered; 0
    /// without hooks).
    pub pause_s: f64,
    /// Making the version visible: the sink's commit (flush, record, the
    /// switch of `DIR/current`; the writes into tensors a caller owns).
    pub apply_s: f64,
    /// Bytes of objects downloaded for this version (`downloaded`).
    pub bytes_downloaded: u64,
    /// Bytes written locally for this version (`written_bytes`).
    pub bytes_written: u64,
    /// The standby slot brought forward after the switch, when a one-shot
    /// run did it (`subscribe --once`: after hooks that confirmed the
    /// version, or into a slot that held nothing): what it cost.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub standby: Option<Produced>,
    /// Bytes the run caused to be written to local storage: slots, journal,
    /// state (`write_bytes` of `/proc/self/io`: pages dirtied in files on a
    /// disk; 0 on tmpfs; absent where the kernel does not say).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub local_write_bytes: Option<u64>,
}

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

/// Whether a failed update should be redone from an anchor (or the version
/// quarantined): yes for what the bucket's data caused (corruption, a wrong
/// base, a missing object), no for what an anchor would not fix (the store
/// unreachable, configuration, local I/O).
pub fn repairable(e: &Error) -> bool {
    !matches!(
        e.kind(),
        ErrorKind::Unavailable | ErrorKind::Config | ErrorKind::Io
    )
}

/// Adds the time since `from` to `acc` (seconds).
fn add_since(acc: &mut f64, from: Instant) {
    *acc += from.elapsed().as_secs_f64();
}

/// An update staged in the sink and not yet committed.
#[derive(Debug)]
struct Staged {
    version: u64,
    out: CaughtUp,
    started: Instant,
    requests: u64,
}

/// Downloads the objects of a replay ahead of their use, in order, with a
/// bounded number of bytes in flight (each download is a task of its own, so
/// it progresses while the sink applies).
struct Prefetch {
    fetcher: Fetcher,
    pending: VecDeque<ObjectEntry>,
    running: VecDeque<(u64, tokio::task::JoinHandle<Result<Bytes>>)>,
    /// Objects read while planning, by key.
    ready: BTreeMap<String, Bytes>,
}

impl Prefetch {
    fn new(
        fetcher: Fetcher,
        objects: Vec<ObjectEntry>,
        ready: BTreeMap<String, Bytes>,
    ) -> Prefetch {
        Prefetch {
            fetcher,
            pending: objects.into(),
            running: VecDeque::new(),
            ready,
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
            if let Some(b) = self.ready.remove(&o.key) {
                self.running
                    .push_back((0, tokio::spawn(async move { Ok(b) })));
                continue;
            }
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

/// A bootstrap object on its way to the sink (see `Subscriber::feed`).
enum Got {
    /// An anchor object, downloaded and checked against its entry.
    Anchor(AnchorObject),
    /// A non-tensor file's bytes.
    File(Bytes),
}

/// A bootstrap object: already at hand, or downloading in a task of its own
/// (aborted if dropped unfinished).
enum Fetching {
    Ready(Got),
    Task(AbortOnDropHandle<Result<Got>>),
}

impl Fetching {
    fn spawn(f: impl std::future::Future<Output = Result<Got>> + Send + 'static) -> Fetching {
        Fetching::Task(AbortOnDropHandle::new(tokio::spawn(f)))
    }

    async fn finish(self) -> Result<Got> {
        match self {
            Fetching::Ready(got) => Ok(got),
            Fetching::Task(task) => task
                .await
                .map_err(|e| Error::io("downloading an object", std::io::Error::other(e)))?,
        }
    }
}

/// A subscriber: a fetcher, a version source and a sink, composed, with the
/// loop's own state (quarantine, pending repairs, the newest version seen).
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
    quarantine: BTreeMap<u64, (Quarantined, Instant)>,
    /// The newest version seen in the bucket.
    newest: Option<u64>,
    /// The next update must start from an anchor (a commit failed
    /// verification: what the sink holds cannot be replayed onto).
    needs_anchor: bool,
    staged: Option<Staged>,
    /// Where the bucket's versions come from.
    log: Log,
    /// Limits of following a TRL bucket.
    pub trl_limits: TrlLimits,
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
            newest: None,
            needs_anchor: false,
            staged: None,
            log: Log::Weightcast,
            trl_limits: TrlLimits::default(),
        }
    }

    /// Follows the bucket as `log` says (a TRL bucket is recognized by its
    /// keys: [`crate::protocol::trl::is_trl_bucket`]).
    pub fn follow(&mut self, log: Log) {
        self.log = log;
    }

    /// Where the bucket's versions come from.
    pub fn log(&self) -> Log {
        self.log
    }

    /// Counts a repair found outside a catch-up (held output found damaged
    /// when the sink was opened); reported by the next catch-up.
    pub fn note_repair(&mut self) {
        self.repairs_found += 1;
    }

    /// The newest version seen in the bucket so far.
    pub fn newest(&self) -> Option<u64> {
        self.newest
    }

    /// Whether the next update will start from an anchor because a commit
    /// failed verification.
    pub fn needs_anchor(&self) -> bool {
        self.needs_anchor
    }

    /// The version staged in the sink and not yet committed.
    pub fn staged(&self) -> Option<u64> {
        self.staged.as_ref().map(|s| s.version)
    }

    /// The quarantined versions, newest first.
    pub fn quarantined(&self) -> Vec<Quarantined> {
        self.quarantine
            .values()
            .rev()
            .map(|(q, _)| q.clone())
            .collect()
    }

    fn see(&mut self, v: u64) {
        self.newest = Some(self.newest.map_or(v, |n| n.max(v)));
    }

    /// Asks the source for the newest version: `None` when the bucket is
    /// empty, `Some(None)` when nothing is new (and no quarantined version
    /// is due for a retry), else the version to aim at.
    async fn target(&mut self, opts: &StepOptions) -> Result<Option<Option<u64>>> {
        let held = self.sink.held();
        // A sink that takes one version per update steps towards a newer
        // version seen before: the hint's ETag does not move between steps.
        let known = self
            .newest
            .filter(|&n| held.is_none_or(|h| n > h) && !opts.thorough);
        let seen = match (known, self.log) {
            (Some(n), _) => Seen::Newest(n),
            (None, Log::Weightcast) => {
                self.source
                    .check(&self.fetcher, held, opts.thorough)
                    .await?
            }
            (None, Log::Trl) => match trl::newest(&self.fetcher).await? {
                None => Seen::Empty,
                Some(t) if held.is_some_and(|h| t <= h) => Seen::Same,
                Some(t) => Seen::Newest(t),
            },
        };
        Ok(Some(match seen {
            Seen::Empty => return Ok(None),
            Seen::Newest(t) => {
                self.see(t);
                Some(t)
            }
            Seen::Same if opts.anchor || self.needs_anchor => held,
            Seen::Same => {
                // Nothing new; a quarantined version may be due for a retry.
                let now = Instant::now();
                let due = self
                    .quarantine
                    .iter()
                    .rev()
                    .find(|(v, (_, at))| held.is_none_or(|h| **v > h) && *at <= now);
                due.map(|_| {
                    self.quarantine
                        .keys()
                        .next_back()
                        .copied()
                        .expect("not empty")
                })
            }
        }))
    }

    /// Whether version `t` may be tried now (not quarantined, or due).
    fn due(&self, t: u64, now: Instant) -> bool {
        self.quarantine.get(&t).is_none_or(|(_, at)| *at <= now)
    }

    /// The next update: the newest committed version (or, while it is
    /// quarantined, the newest older one that is due), planned from what
    /// the sink holds. `None` when nothing is new. A sink that takes one
    /// version per update ([`Sink::max_versions`]) gets the first version
    /// of a replay; a bootstrap always reaches the target.
    pub async fn next_update(&mut self, opts: &StepOptions) -> Result<Option<Update>> {
        let held = self.sink.held();
        let Some(Some(newest)) = self.target(opts).await? else {
            return Ok(None);
        };
        let now = Instant::now();
        let mut t = newest;
        while !self.due(t, now) {
            match t.checked_sub(1) {
                Some(older) if held.is_none_or(|h| older > h) => t = older,
                _ => return Ok(None),
            }
        }
        if held == Some(t) && !(opts.anchor || self.needs_anchor) {
            return Ok(None);
        }
        self.plan(t, opts.anchor || self.needs_anchor).await
    }

    /// Plans the way from what the sink holds to `target` (for a TRL
    /// bucket, to the newest step at or below it); `None` when there is
    /// nothing to do.
    async fn plan(&self, target: u64, anchor: bool) -> Result<Option<Update>> {
        let held = self.sink.held();
        let mut u = match self.log {
            Log::Trl => {
                let names = self.sink.held_tensors();
                match trl::plan(
                    &self.fetcher,
                    held,
                    Some(target),
                    names,
                    anchor,
                    &self.trl_limits,
                )
                .await?
                {
                    Some(u) => u,
                    None => return Ok(None),
                }
            }
            Log::Weightcast => {
                let (mut plan, mut chain) = plan::plan(&self.fetcher, held, target).await?;
                if anchor || plan == Plan::UpToDate {
                    let a = chain[&target].anchor_version;
                    plan = Plan::Bootstrap {
                        anchor: a,
                        replay: (a + 1..=target).collect(),
                    };
                    plan::complete(&self.fetcher, &plan, &mut chain).await?;
                }
                // A replay through a quarantined version would fail again:
                // from the target's anchor instead.
                if let Plan::Replay(vs) = &plan
                    && vs.iter().any(|v| self.quarantine.contains_key(v))
                {
                    let a = chain[&target].anchor_version;
                    plan = Plan::Bootstrap {
                        anchor: a,
                        replay: (a + 1..=target).collect(),
                    };
                    plan::complete(&self.fetcher, &plan, &mut chain).await?;
                }
                Update {
                    version: target,
                    target,
                    base: matches!(plan, Plan::Replay(_)).then_some(held).flatten(),
                    plan,
                    chain,
                    ready: BTreeMap::new(),
                    structural_only: false,
                }
            }
        };
        if let (Plan::Replay(vs), Some(k)) = (&mut u.plan, self.sink.max_versions()) {
            vs.truncate(k.max(1));
            u.version = *vs.last().expect("a replay has a version");
        }
        Ok(Some(u))
    }

    /// Stages `update` in the sink: its objects are downloaded (each checked
    /// against its manifest entry) and handed over, every version checked
    /// complete, nothing made visible. A replay that fails verification is
    /// redone from the anchor; a version that cannot be verified at all is
    /// quarantined. An update staged before and not committed is dropped.
    pub async fn stage(&mut self, update: Update) -> Result<()> {
        if self.staged.take().is_some() {
            self.sink.abort();
        }
        let requests = self.fetcher.requests();
        let started = Instant::now();
        let held = self.sink.held();
        if update.base.is_some() && update.base != held {
            return Err(Error::Conflict(format!(
                "the update takes version {:?} to {}, but the sink now holds {held:?}; plan again",
                update.base, update.version
            )));
        }
        let version = update.version;
        let mut out = CaughtUp {
            version,
            previous: held,
            repairs: std::mem::take(&mut self.repairs_found),
            structural_only: update.structural_only,
            ..CaughtUp::default()
        };
        let target = update.target;
        match self.stage_repairing(update, &mut out).await {
            Ok(reached) => {
                out.version = reached;
                // What the sink did not take was waiting on the store.
                out.fetch_s = (started.elapsed().as_secs_f64() - out.prepare_s).max(0.0);
                self.staged = Some(Staged {
                    version: reached,
                    out,
                    started,
                    requests,
                });
                Ok(())
            }
            Err(e) => {
                self.sink.abort();
                self.repairs_found += out.repairs;
                if repairable(&e) {
                    // The repair aimed at the target: it is what cannot be
                    // verified (the version too, when the step was shorter).
                    self.quarantine_version(target, &e);
                    if version != target {
                        self.quarantine_version(version, &e);
                    }
                }
                Err(e)
            }
        }
    }

    /// Stages the update, repairing a failed replay from the anchor of its
    /// target; returns the version reached.
    async fn stage_repairing(&mut self, mut update: Update, out: &mut CaughtUp) -> Result<u64> {
        if let Plan::Replay(versions) = &update.plan {
            let versions = versions.clone();
            match self
                .feed(
                    update.base,
                    None,
                    &versions,
                    &update.chain,
                    &mut update.ready,
                    out,
                )
                .await
            {
                Ok(()) => return Ok(update.version),
                Err(e) if repairable(&e) && self.log == Log::Weightcast => {
                    tracing::warn!(error = %e, "replay failed; repairing from the anchor");
                    self.sink.abort();
                    out.repairs += 1;
                    out.downloaded = 0;
                    out.deltas_applied = 0;
                    out.changed_tensors.clear();
                }
                Err(e) => return Err(e),
            }
        }
        let (anchor, replay) = match &update.plan {
            Plan::Bootstrap { anchor, replay } => (*anchor, replay.clone()),
            _ => {
                let t = update.target;
                let anchor = update.chain[&t].anchor_version;
                let boot = Plan::Bootstrap {
                    anchor,
                    replay: (anchor + 1..=t).collect(),
                };
                plan::complete(&self.fetcher, &boot, &mut update.chain).await?;
                update.version = t;
                (anchor, (anchor + 1..=t).collect())
            }
        };
        out.from_anchor = true;
        self.feed(
            None,
            Some(anchor),
            &replay,
            &update.chain,
            &mut update.ready,
            out,
        )
        .await?;
        out.changed_tensors.clear();
        Ok(update.version)
    }

    /// Starts getting bootstrap object `o`: from `ready` (read while
    /// planning), or downloaded where the sink wants it.
    fn start_bootstrap_object(
        &mut self,
        o: &ObjectEntry,
        ready: &mut BTreeMap<String, Ready>,
    ) -> Result<Fetching> {
        let f = self.fetcher.clone();
        let o = o.clone();
        Ok(match (o.role, ready.remove(&o.key)) {
            (ObjectRole::Anchor, Some(Ready::Tensors(set))) => {
                Fetching::Ready(Got::Anchor(AnchorObject::Tensors(set)))
            }
            (ObjectRole::Anchor, _) => match self.sink.anchor_dest(&o.name)? {
                AnchorDest::Memory => Fetching::spawn(async move {
                    Ok(Got::Anchor(AnchorObject::Bytes(
                        f.bytes(&o).await?.to_vec(),
                    )))
                }),
                // Decoded while it downloads where it can be.
                AnchorDest::File(p) => Fetching::spawn(async move {
                    Ok(Got::Anchor(match f.anchor_to_file(&o, &p).await? {
                        Some(layout) => AnchorObject::Expanded(p, Box::new(layout)),
                        None => AnchorObject::File(p),
                    }))
                }),
            },
            (_, Some(Ready::Bytes(body))) => Fetching::Ready(Got::File(body)),
            _ => Fetching::spawn(async move { Ok(Got::File(f.bytes(&o).await?)) }),
        })
    }

    async fn feed(
        &mut self,
        base: Option<u64>,
        anchor: Option<u64>,
        replay: &[u64],
        chain: &BTreeMap<u64, Manifest>,
        ready: &mut BTreeMap<String, Ready>,
        out: &mut CaughtUp,
    ) -> Result<()> {
        let t = Instant::now();
        self.sink.begin(base)?;
        add_since(&mut out.prepare_s, t);
        // The replay's objects start downloading now, beside the anchor's
        // (at most PREFETCH_BYTES ahead), so that a fresh subscriber's deltas
        // are in hand when its anchor is.
        let objects: Vec<ObjectEntry> = replay
            .iter()
            .flat_map(|v| chain[v].replay_objects().cloned())
            .collect();
        let mut bytes = BTreeMap::new();
        for o in &objects {
            if matches!(ready.get(&o.key), Some(Ready::Bytes(_)))
                && let Some(Ready::Bytes(b)) = ready.remove(&o.key)
            {
                bytes.insert(o.key.clone(), b);
            }
        }
        let mut prefetch = Prefetch::new(self.fetcher.clone(), objects, bytes);
        prefetch.fill();
        if let Some(a) = anchor {
            let m = &chain[&a];
            // The next objects download while this one is decoded into the
            // sink (the link and the cores both busy): up to
            // [`ANCHOR_DOWNLOADS`] at a time, in order, holding at most
            // [`ANCHOR_AHEAD_BYTES`] (or one object) beyond the one decoded.
            let objects: Vec<&ObjectEntry> = m.bootstrap_objects().collect();
            let mut started: VecDeque<(u64, Fetching)> = VecDeque::new();
            let mut queued = 0;
            for (i, o) in objects.iter().enumerate() {
                if started.is_empty() {
                    started.push_back((o.size, self.start_bootstrap_object(o, ready)?));
                    queued = i + 1;
                }
                let this = started.pop_front().expect("started").1;
                while let Some(n) = objects.get(queued) {
                    // Sizes from the manifest, not yet checked: saturating.
                    let ahead = started.iter().fold(0u64, |t, s| t.saturating_add(s.0));
                    if !started.is_empty()
                        && (started.len() >= ANCHOR_DOWNLOADS
                            || ahead.saturating_add(n.size) > ANCHOR_AHEAD_BYTES)
                    {
                        break;
                    }
                    started.push_back((n.size, self.start_bootstrap_object(n, ready)?));
                    queued += 1;
                }
                out.downloaded += o.size;
                let got = this.finish().await?;
                let t = Instant::now();
                match got {
                    Got::Anchor(object) => self.sink.anchor(&o.name, object)?,
                    Got::File(body) => self.sink.file(a, &o.name, &body)?,
                }
                add_since(&mut out.prepare_s, t);
            }
            let t = Instant::now();
            self.sink.version_done(m)?;
            add_since(&mut out.prepare_s, t);
        }
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
                let t = Instant::now();
                if o.role == ObjectRole::Delta {
                    let report = match self.sink.delta(*v, &o.name, &body) {
                        Ok(r) => r,
                        Err(e) if self.log == Log::Trl => {
                            return Err(crate::protocol::trl::in_object(&o.key, e));
                        }
                        Err(e) => return Err(e),
                    };
                    // A TRL bucket's deltas were checked against their keys
                    // while planning; TRL's own carry no digests.
                    let checked = report.verified && report.model_version == Some(*v);
                    if !checked && self.log == Log::Weightcast {
                        return Err(Error::metadata(
                            "delta",
                            format!(
                                "the delta for `{}` is not a verified delta to version {v}",
                                o.name
                            ),
                        ));
                    }
                    out.structural_only |= !report.verified;
                    changed.extend(report.changed_tensors);
                } else {
                    self.sink.file(*v, &o.name, &body)?;
                }
                add_since(&mut out.prepare_s, t);
            }
            let t = Instant::now();
            self.sink.version_done(m)?;
            add_since(&mut out.prepare_s, t);
            out.deltas_applied += 1;
        }
        out.changed_tensors = changed.into_iter().collect();
        Ok(())
    }

    /// Makes the staged update visible. A commit that fails verification
    /// makes the next update start from an anchor; nothing visible changes
    /// on failure.
    pub fn commit(&mut self) -> Result<CaughtUp> {
        let staged = self.staged.take().ok_or_else(|| {
            Error::BadRequest("no update is staged (stage one first, or it was dropped)".into())
        })?;
        let t = Instant::now();
        match self.sink.commit() {
            Ok(p) => {
                let mut c = self.committed(staged, p);
                c.apply_s = t.elapsed().as_secs_f64();
                Ok(c)
            }
            Err(e) => {
                if e.kind() == ErrorKind::Corrupt {
                    self.needs_anchor = true;
                    tracing::warn!(error = %e, "commit refused; the next update starts from an anchor");
                }
                // The sink keeps what it can retry (a commit into the wrong
                // tensors writes nothing); one that cannot says so then.
                self.staged = Some(staged);
                Err(e)
            }
        }
    }

    fn committed(&mut self, staged: Staged, p: Produced) -> CaughtUp {
        let mut out = staged.out;
        let t = staged.version;
        self.see(t);
        self.needs_anchor = false;
        self.quarantine.remove(&t);
        // Versions at or below the one reached are moot.
        self.quarantine.retain(|v, _| *v > t);
        out.written_bytes = p.written_bytes;
        out.journal_bytes = p.journal_bytes;
        out.cloned_bytes = p.cloned_bytes;
        out.slot = p.slot;
        out.requests = self.fetcher.requests() - staged.requests;
        out.quarantined = self.quarantined();
        out.bytes_downloaded = out.downloaded;
        out.bytes_written = out.written_bytes;
        if out.from_anchor {
            // After an anchor any tensor may have changed: all are listed.
            let mut all = self.sink.held_tensors().unwrap_or_default();
            all.sort();
            all.dedup();
            out.changed_tensors = all;
        }
        tracing::debug!(
            version = t,
            seconds = staged.started.elapsed().as_secs_f64(),
            "update committed"
        );
        out
    }

    /// Notes that what the sink holds failed verification outside a commit
    /// (a sink over the caller's tensors checks them when it prepares): the
    /// next update starts from an anchor. The staged update stays.
    pub fn distrust_held(&mut self) {
        self.needs_anchor = true;
        tracing::warn!(
            "the held tensors failed verification; the next update starts from an anchor"
        );
    }

    /// Drops the staged update, if any; what is visible stays as it was.
    pub fn abort(&mut self) {
        if self.staged.take().is_some() {
            self.sink.abort();
        }
    }

    /// One catch-up to the newest committed version: [`next_update`],
    /// [`stage`] and [`commit`] in a row. `thorough` makes the source list
    /// the bucket even if the hint did not move (see [`super::source`]).
    /// Returns `None` when the bucket has no version yet.
    ///
    /// A version that cannot be verified (what the bucket holds is corrupt,
    /// missing or unreadable — not the store being unreachable) is
    /// quarantined: the subscriber keeps its verified version, or reaches
    /// the newest older version it can verify (up to three per catch-up),
    /// reports the bad one in [`CaughtUp::quarantined`], and tries it again
    /// after a backoff (30 s doubling to an hour). A later good version or
    /// anchor moves it on.
    ///
    /// [`next_update`]: Subscriber::next_update
    /// [`stage`]: Subscriber::stage
    /// [`commit`]: Subscriber::commit
    pub async fn catch_up(&mut self, thorough: bool) -> Result<Option<CaughtUp>> {
        let requests = self.fetcher.requests();
        let held = self.sink.held();
        let opts = StepOptions {
            thorough,
            anchor: false,
        };
        let newest = match self.target(&opts).await? {
            None => return Ok(None),
            Some(Some(t)) => t,
            Some(None) => {
                let Some(h) = held else { return Ok(None) };
                let mut c = CaughtUp::unchanged(h, self.fetcher.requests() - requests);
                c.quarantined = self.quarantined();
                return Ok(Some(c));
            }
        };
        let now = Instant::now();
        let mut last_error = None;
        let mut tried = 0;
        let mut candidate = Some(newest);
        while let Some(t) = candidate {
            // Down to the held version; below it only when the bucket's
            // newest is older (the held version vanished from the bucket).
            if held.is_some_and(|h| (t == h && !self.needs_anchor) || (t < h && t != newest)) {
                break;
            }
            if self.due(t, now) {
                if tried == FALLBACK_TARGETS {
                    break;
                }
                tried += 1;
                let planning = Instant::now();
                let planned = self.plan(t, self.needs_anchor).await;
                let plan_s = planning.elapsed().as_secs_f64();
                let u = match planned {
                    Ok(Some(u)) => u,
                    // Nothing at or below `t` is newer than what is held.
                    Ok(None) => break,
                    Err(e) if repairable(&e) => {
                        self.quarantine_version(t, &e);
                        last_error = Some(e);
                        candidate = t.checked_sub(1);
                        continue;
                    }
                    Err(e) => return Err(e),
                };
                let v = u.version;
                let reached = match self.stage(u).await {
                    Ok(()) => self.commit(),
                    Err(e) => Err(e),
                };
                match reached {
                    Ok(mut c) => {
                        c.requests = self.fetcher.requests() - requests;
                        // Planning read the listing and manifests.
                        c.fetch_s += plan_s;
                        return Ok(Some(c));
                    }
                    Err(e) if repairable(&e) => {
                        // `stage` quarantined it; a failed commit too.
                        if !self.quarantine.contains_key(&v) {
                            self.quarantine_version(v, &e);
                        }
                        last_error = Some(e);
                        candidate = v.checked_sub(1);
                        continue;
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
                Instant::now() + wait,
            ),
        );
    }

    /// Materializes `version` in the output directory `dir` (created) as
    /// `weightcast subscribe --out DIR` does: a subscriber over the same
    /// store, with a directory sink of `slots` slots, brought to exactly that
    /// version ([`Subscriber::catch_up_to`]).
    pub async fn save_to(
        &self,
        dir: &std::path::Path,
        slots: usize,
        version: u64,
    ) -> Result<CaughtUp> {
        std::fs::create_dir_all(dir)
            .map_err(|e| Error::io(format!("creating {}", dir.display()), e))?;
        let sink = super::dir::DirSink::open(dir, slots)?;
        let source = VersionSource::new(Duration::from_secs(1), 0.0);
        let mut sub = Subscriber::new(self.fetcher.clone(), source, sink);
        sub.follow(self.log);
        sub.catch_up_to(version).await
    }

    /// Brings the sink to exactly version `target` (committed in the bucket),
    /// newer or older than what it holds: a replay when that is cheaper,
    /// otherwise from the anchor, verified and repaired as
    /// [`Subscriber::catch_up`] does (no quarantine: the caller chose the
    /// version). For callers that choose the version themselves (a Python
    /// `Update.save_to`).
    pub async fn catch_up_to(&mut self, target: u64) -> Result<CaughtUp> {
        let requests = self.fetcher.requests();
        let held = self.sink.held();
        if held == Some(target) {
            return Ok(CaughtUp::unchanged(target, 0));
        }
        let u = self.plan(target, false).await?.ok_or_else(|| {
            Error::NotFound(format!(
                "version {target} is not in `{}`",
                self.fetcher.store().url()
            ))
        })?;
        self.stage(u).await?;
        self.quarantine.remove(&target);
        let mut c = self.commit()?;
        c.requests = self.fetcher.requests() - requests;
        Ok(c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::generator::{Generator, GeneratorConfig};
    use crate::publisher::{Checkpoint, PublishOptions, Publisher, PublisherConfig};
    use crate::store::Store;
    use crate::subscriber::sink::MemorySink;
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
