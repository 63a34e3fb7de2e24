//! The sink conformance suite: every sink the subscriber's one loop
//! (`subscriber::step`) feeds — the output directory's slots ([`DirSink`]),
//! memory ([`MemorySink`]) and the caller's own tensors ([`LentSink`]) — runs
//! the same catch-up sequences, as every object_store backend runs the store
//! conformance suite (`conformance.rs`):
//!
//! - a bootstrap from an anchor; delta chains one behind and several behind;
//!   a replay across a bridged anchor; a late joiner;
//! - a repair: a corrupt bridge delta, redone from its anchor;
//! - quarantine: a corrupt newest version is skipped and reported, the newest
//!   older version served — by a follower and by a fresh subscriber;
//! - a crash at each phase of a step (after planning, after staging, after
//!   committing): the subscriber is dropped there and restarted on what the
//!   sink keeps, and converges;
//! - a bucket in TRL's own layout, followed through the same loop.
//!
//! After every step each sink must hold exactly the publisher's tensors at
//! its version: bit-identical to the truth, hence across sinks.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use bytes::Bytes;
use weightcast::format::{Encoding, TrlGeneration, TrlOptions};
use weightcast::generator::{Generator, GeneratorConfig};
use weightcast::protocol::{ObjectRole, read_manifest};
use weightcast::publisher::{AnchorPolicy, Checkpoint, PublishOptions, Publisher, PublisherConfig};
use weightcast::store::Store;
use weightcast::subscriber::lent::LentTensor;
use weightcast::subscriber::{
    CaughtUp, DirSink, Fetcher, LentSink, Log, MemorySink, Sink, StepOptions, Subscriber,
    VersionSource,
};
use weightcast::tensors::{Digests, TensorSet};

use crate::common;

const FILE: &str = "model.safetensors";

/// Every sink kind.
const KINDS: [Kind; 3] = [Kind::Dir, Kind::Memory, Kind::Lent];

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Dir,
    Memory,
    Lent,
}

fn source() -> VersionSource {
    VersionSource::new(Duration::from_secs(1), 0.0)
}

/// A subscriber over one kind of sink, and what a restart keeps.
enum Under {
    Dir(Subscriber<DirSink>, PathBuf),
    Memory(Subscriber<MemorySink>),
    /// The caller's tensors live in the test, lent for each commit.
    Lent(Subscriber<LentSink>, Vec<LentTensor>),
}

impl Under {
    fn new(kind: Kind, store: &Store, dir: &Path, log: Log) -> Under {
        let f = Fetcher::new(store.clone());
        let mut u = match kind {
            Kind::Dir => {
                std::fs::create_dir_all(dir).unwrap();
                Under::Dir(
                    Subscriber::new(f, source(), DirSink::open(dir, 2).unwrap()),
                    dir.to_path_buf(),
                )
            }
            Kind::Memory => Under::Memory(Subscriber::new(f, source(), MemorySink::new())),
            Kind::Lent => Under::Lent(
                Subscriber::new(f, source(), LentSink::new(None)),
                Vec::new(),
            ),
        };
        match &mut u {
            Under::Dir(s, _) => s.follow(log),
            Under::Memory(s) => s.follow(log),
            Under::Lent(s, _) => s.follow(log),
        }
        u
    }

    /// A restart after a crash: the directory's state survives, memory does
    /// not, and the caller's tensors survive (their version is unknown).
    fn restart(self, store: &Store, log: Log) -> Under {
        match self {
            Under::Dir(s, dir) => {
                drop(s);
                Under::new(Kind::Dir, store, &dir, log)
            }
            Under::Memory(_) => Under::new(Kind::Memory, store, Path::new(""), log),
            Under::Lent(_, tensors) => {
                let mut u = Under::new(Kind::Lent, store, Path::new(""), log);
                if let Under::Lent(_, t) = &mut u {
                    *t = tensors;
                }
                u
            }
        }
    }

    fn version(&self) -> Option<u64> {
        match self {
            Under::Dir(s, _) => s.sink.held(),
            Under::Memory(s) => s.sink.held(),
            Under::Lent(s, _) => s.sink.held(),
        }
    }

    /// One catch-up: the loop's `catch_up` for the sinks that take several
    /// versions at once; for the caller's tensors, what an engine does —
    /// `next_update`, `stage`, the tensors lent to the commit — until
    /// nothing is new. Returns the last step's report.
    async fn catch_up(&mut self) -> Option<CaughtUp> {
        match self {
            Under::Dir(s, _) => s.catch_up(true).await.unwrap(),
            Under::Memory(s) => s.catch_up(true).await.unwrap(),
            Under::Lent(s, tensors) => {
                let mut last = None;
                let mut thorough = true;
                for _ in 0..64 {
                    let opts = StepOptions {
                        thorough,
                        anchor: false,
                    };
                    thorough = false;
                    let Some(u) = s.next_update(&opts).await.unwrap() else {
                        break;
                    };
                    if s.stage(u).await.is_err() {
                        // Quarantined: the next update aims lower.
                        continue;
                    }
                    allocate(s, tensors);
                    let (back, r) = s.commit_into(std::mem::take(tensors), false);
                    *tensors = back;
                    last = Some(r.unwrap());
                }
                last.or_else(|| {
                    s.sink.held().map(|v| CaughtUp {
                        version: v,
                        previous: Some(v),
                        quarantined: s.quarantined(),
                        ..CaughtUp::default()
                    })
                })
            }
        }
    }

    /// Every tensor held: name → bytes.
    fn tensors(&self) -> BTreeMap<String, Vec<u8>> {
        let of = |set: &TensorSet| {
            set.tensors()
                .iter()
                .enumerate()
                .map(|(i, t)| (t.name.clone(), set.data(i).to_vec()))
                .collect::<Vec<_>>()
        };
        match self {
            Under::Dir(s, _) => s
                .sink
                .current_dir()
                .read_dir()
                .unwrap()
                .flatten()
                .filter(|e| e.file_name().to_string_lossy().ends_with(".safetensors"))
                .flat_map(|e| of(&TensorSet::read(&e.path(), Digests::Skip).unwrap()))
                .collect(),
            Under::Memory(s) => s.sink.tensors().values().flat_map(of).collect(),
            Under::Lent(_, tensors) => tensors
                .iter()
                .map(|t| (t.name.clone(), t.buf.bytes().to_vec()))
                .collect(),
        }
    }
}

/// The engine's tensors, allocated (zeroed) with the structure of the first
/// anchor staged for them.
fn allocate(s: &Subscriber<LentSink>, tensors: &mut Vec<LentTensor>) {
    if !tensors.is_empty() {
        return;
    }
    for set in s.sink.staged_tensors().expect("an anchor first").values() {
        for (i, t) in set.tensors().iter().enumerate() {
            tensors.push(LentTensor {
                name: t.name.clone(),
                dtype: t.dtype,
                shape: t.shape.clone(),
                buf: Box::new(vec![0u8; set.data(i).len()]),
            });
        }
    }
}

/// A publisher of generator steps, and the truth of every version.
struct Trainer {
    publisher: Publisher,
    generator: Generator,
    truth: Vec<BTreeMap<String, Vec<u8>>>,
}

impl Trainer {
    async fn new(store: &Store, state: &Path, every: u64, encoding: Encoding) -> Trainer {
        let mut cfg = PublisherConfig::new(state);
        cfg.encoding = encoding;
        cfg.anchors = AnchorPolicy {
            every,
            ..AnchorPolicy::default()
        };
        Trainer {
            publisher: Publisher::open(store.clone(), cfg).await.unwrap(),
            generator: Generator::new(GeneratorConfig::tiny(31)),
            truth: Vec::new(),
        }
    }

    /// Publishes the next step; returns its version.
    async fn step(&mut self) -> u64 {
        if !self.truth.is_empty() {
            self.generator.step();
        }
        let set = self.generator.snapshot();
        self.truth.push(
            set.tensors()
                .iter()
                .enumerate()
                .map(|(i, t)| (t.name.clone(), set.data(i).to_vec()))
                .collect(),
        );
        let cp = Checkpoint::from_sets(
            BTreeMap::from([(FILE.to_string(), self.generator.snapshot_without_digests())]),
            BTreeMap::new(),
        )
        .unwrap();
        let step = Some(self.truth.len() as u64);
        let p = self.publisher.publish(cp, &PublishOptions { step }).await;
        let v = p.unwrap().version;
        assert_eq!(v as usize + 1, self.truth.len());
        v
    }
}

/// Every sink holds exactly the truth of its version.
fn assert_exact(
    subs: &[(Kind, Under)],
    truth: &[BTreeMap<String, Vec<u8>>],
    want: u64,
    what: &str,
) {
    for (kind, u) in subs {
        assert_eq!(u.version(), Some(want), "{kind:?}: {what}");
        let got = u.tensors();
        assert!(
            got == truth[want as usize],
            "{kind:?}: {what}: the tensors differ from version {want}'s"
        );
    }
}

/// Overwrites the object of `role` for version `v` with as many other bytes.
async fn corrupt(store: &Store, v: u64, role: ObjectRole) {
    let m = read_manifest(store, v).await.unwrap().unwrap();
    let o = m.objects.iter().find(|o| o.role == role).unwrap();
    let mut body = store.get(&o.key).await.unwrap().unwrap().to_vec();
    for b in body.iter_mut().skip(64) {
        *b ^= 0x5a;
    }
    store.put(&o.key, Bytes::from(body)).await.unwrap();
}

#[tokio::test]
async fn every_sink_follows_the_same_sequences_bit_identically() {
    same_sequences(Encoding::Compact).await;
}

/// The same with `compact2` deltas: every sink keeps the context each delta
/// was coded against — across a bridged anchor, a repair and a quarantine.
#[tokio::test]
async fn every_sink_follows_the_same_compact2_sequences_bit_identically() {
    same_sequences(Encoding::Compact2).await;
}

async fn same_sequences(encoding: Encoding) {
    let (store, _bucket) = common::local_store();
    let work = tempfile::tempdir().unwrap();
    let dir = |k: Kind, n: &str| work.path().join(format!("{k:?}-{n}"));
    let mut t = Trainer::new(&store, &work.path().join("state"), 4, encoding).await;
    let log = Log::Weightcast;
    let mut subs: Vec<(Kind, Under)> = KINDS
        .iter()
        .map(|&k| (k, Under::new(k, &store, &dir(k, "a"), log)))
        .collect();
    for (_, u) in &mut subs {
        assert!(u.catch_up().await.is_none(), "an empty bucket");
    }

    // A bootstrap, then one delta behind at a time.
    for _ in 0..3 {
        let v = t.step().await;
        for (_, u) in &mut subs {
            let c = u.catch_up().await.unwrap();
            assert_eq!((c.version, c.from_anchor), (v, v == 0));
        }
        assert_exact(&subs, &t.truth, v, "one behind");
    }
    // The first delta after an anchor has no context; the next one has.
    assert!(!common::coded_with_context(&store, 1).await);
    assert_eq!(
        common::coded_with_context(&store, 2).await,
        encoding == Encoding::Compact2
    );
    // Several behind, across an anchor with bridges (every 4: version 4).
    let mut v = 0;
    for _ in 0..3 {
        v = t.step().await;
    }
    for (kind, u) in &mut subs {
        let c = u.catch_up().await.unwrap();
        assert_eq!(c.version, v);
        assert!(
            !c.from_anchor,
            "{kind:?}: replays across the bridged anchor: {c:?}"
        );
    }
    assert_exact(
        &subs,
        &t.truth,
        v,
        "several behind, across a bridged anchor",
    );

    // A late joiner starts from the newest anchor and replays after it.
    for &k in &KINDS {
        let mut late = Under::new(k, &store, &dir(k, "late"), log);
        let c = late.catch_up().await.unwrap();
        assert_eq!(c.version, v, "{k:?}");
        assert_exact(&[(k, late)], &t.truth, v, "a late joiner");
    }

    // A repair: the bridge of the next anchor (version 8) is corrupt, so the
    // replay onto it fails and is redone from the anchor itself.
    t.step().await;
    let v7 = t.step().await;
    assert_eq!(v7, 7);
    for (_, u) in &mut subs {
        u.catch_up().await.unwrap();
    }
    assert_exact(&subs, &t.truth, v7, "before the repair");
    let v8 = t.step().await;
    let m8 = read_manifest(&store, v8).await.unwrap().unwrap();
    assert!(
        m8.objects.iter().any(|o| o.role == ObjectRole::Delta)
            && m8.objects.iter().any(|o| o.role == ObjectRole::Anchor),
        "version {v8} is a bridged anchor"
    );
    corrupt(&store, v8, ObjectRole::Delta).await;
    for (kind, u) in &mut subs {
        let c = u.catch_up().await.unwrap();
        assert_eq!((c.version, c.from_anchor), (v8, true), "{kind:?}: {c:?}");
        assert!(c.repairs >= 1, "{kind:?}: {c:?}");
    }
    assert_exact(&subs, &t.truth, v8, "repaired from the anchor");

    // Quarantine: the newest delta is corrupt. Followers stay at their
    // version and report it; a fresh subscriber serves the version before.
    let v9 = t.step().await;
    corrupt(&store, v9, ObjectRole::Delta).await;
    for (kind, u) in &mut subs {
        let c = u.catch_up().await.unwrap();
        assert_eq!(c.version, v8, "{kind:?}: {c:?}");
        assert_eq!(
            c.quarantined.first().map(|q| q.version),
            Some(v9),
            "{kind:?}: {c:?}"
        );
    }
    assert_exact(&subs, &t.truth, v8, "the bad version quarantined");
    for &k in &KINDS {
        let mut fresh = Under::new(k, &store, &dir(k, "fresh"), log);
        let c = fresh.catch_up().await.unwrap();
        assert_eq!(c.version, v8, "{k:?}: {c:?}");
        assert_exact(
            &[(k, fresh)],
            &t.truth,
            v8,
            "a fresh subscriber below a bad version",
        );
    }
    // The next anchor moves everyone on.
    let mut v = v9;
    while read_manifest(&store, v)
        .await
        .unwrap()
        .unwrap()
        .anchor_version
        != v
    {
        v = t.step().await;
    }
    corrupt(&store, v, ObjectRole::Delta).await; // its bridge hangs on v9
    for (kind, u) in &mut subs {
        let c = u.catch_up().await.unwrap();
        assert_eq!((c.version, c.from_anchor), (v, true), "{kind:?}: {c:?}");
        assert!(c.quarantined.is_empty(), "{kind:?}: {c:?}");
    }
    assert_exact(
        &subs,
        &t.truth,
        v,
        "past the bad version at the next anchor",
    );
}

/// A crash at each phase of a step: the subscriber is dropped after
/// planning, after staging and after committing, restarted on what its sink
/// keeps, and catches up to the truth.
#[tokio::test]
async fn a_crash_at_each_phase_converges_in_every_sink() {
    crash_at_each_phase(Encoding::Compact).await;
}

/// The same with `compact2` deltas: a restarted directory finds the context
/// of its version in its journal.
#[tokio::test]
async fn a_crash_at_each_phase_converges_in_every_sink_with_compact2() {
    crash_at_each_phase(Encoding::Compact2).await;
}

async fn crash_at_each_phase(encoding: Encoding) {
    let (store, _bucket) = common::local_store();
    let work = tempfile::tempdir().unwrap();
    let mut t = Trainer::new(&store, &work.path().join("state"), 5, encoding).await;
    let log = Log::Weightcast;
    for &kind in &KINDS {
        let dir = work.path().join(format!("{kind:?}"));
        let mut u = Under::new(kind, &store, &dir, log);
        let v = t.step().await;
        u.catch_up().await.unwrap();
        assert_exact(&[(kind, u)], &t.truth, v, "before");
        u = Under::new(kind, &store, &dir, log).restart(&store, log);
        if kind != Kind::Memory && kind != Kind::Lent {
            assert_eq!(
                u.version(),
                Some(v),
                "{kind:?}: the directory keeps its version"
            );
        }
        for phase in ["planned", "staged", "committed"] {
            let v = t.step().await;
            let step = async |u: &mut Under| -> bool {
                let opts = StepOptions {
                    thorough: true,
                    anchor: false,
                };
                macro_rules! go {
                    ($s:expr, $commit:expr) => {{
                        let Some(up) = $s.next_update(&opts).await.unwrap() else {
                            return false;
                        };
                        if phase == "planned" {
                            return true;
                        }
                        $s.stage(up).await.unwrap();
                        if phase == "staged" {
                            return true;
                        }
                        $commit;
                        true
                    }};
                }
                match u {
                    Under::Dir(s, _) => go!(s, s.commit().unwrap()),
                    Under::Memory(s) => go!(s, s.commit().unwrap()),
                    Under::Lent(s, tensors) => go!(s, {
                        allocate(s, tensors);
                        let (back, r) = s.commit_into(std::mem::take(tensors), false);
                        *tensors = back;
                        r.unwrap()
                    }),
                }
            };
            assert!(step(&mut u).await, "{kind:?}: {phase}: an update");
            // Crash, restart, catch up: a directory goes on from the
            // version it keeps (with its context, for `compact2`).
            u = u.restart(&store, log);
            let c = u.catch_up().await;
            if kind == Kind::Dir
                && let Some(c) = c
            {
                assert!(!c.from_anchor && c.repairs == 0, "{phase}: {c:?}");
            }
            assert_exact(
                &[(kind, u)],
                &t.truth,
                v,
                &format!("after a crash once {phase}"),
            );
            u = Under::new(kind, &store, &dir, log);
            if kind == Kind::Dir {
                assert_eq!(u.version(), Some(v), "{phase}: reopened");
            } else {
                u.catch_up().await;
            }
        }
    }
}

/// A bucket in TRL's own layout (written as `publish --layout trl` writes
/// it: TRL's keys and, beside them, weightcast's digests) is followed through
/// the same loop into every sink, bit-identically.
#[tokio::test]
async fn every_sink_follows_a_trl_bucket() {
    let (store, _bucket) = common::local_store();
    let work = tempfile::tempdir().unwrap();
    let mut g = Generator::new(GeneratorConfig::tiny(41));
    let mut truth: Vec<BTreeMap<String, Vec<u8>>> = Vec::new();
    let opts = TrlOptions {
        generation: TrlGeneration::V3,
        ..TrlOptions::default()
    };
    let mut subs: Vec<(Kind, Under)> = KINDS
        .iter()
        .map(|&k| {
            (
                k,
                Under::new(k, &store, &work.path().join(format!("{k:?}")), Log::Trl),
            )
        })
        .collect();
    let mut base: Option<TensorSet> = None;
    for step in 1..=7u64 {
        g.step();
        let mut set = g.snapshot_without_digests();
        if weightcast::protocol::trl::is_anchor_step(step, 3) {
            let s = g.snapshot();
            weightcast::protocol::trl::put_anchor(&store, &s, step, &opts)
                .await
                .unwrap();
            base = Some(s);
        } else {
            weightcast::protocol::trl::put_delta(
                &store,
                base.as_ref().unwrap(),
                &mut set,
                step,
                &opts,
            )
            .await
            .unwrap();
            base = Some(set);
        }
        let b = base.as_ref().unwrap();
        truth.push(
            b.tensors()
                .iter()
                .enumerate()
                .map(|(i, t)| (t.name.clone(), b.data(i).to_vec()))
                .collect(),
        );
        for (kind, u) in &mut subs {
            let c = u.catch_up().await.unwrap();
            assert_eq!(c.version + 1, step, "{kind:?}: {c:?}");
            assert!(
                !c.structural_only || *kind == Kind::Lent,
                "{kind:?}: digests verified"
            );
        }
        assert_exact(&subs, &truth, step - 1, &format!("TRL step {step}"));
    }
}
