//! The publisher end to end on real stores: versions committed from checkpoints
//! on disk replay bit-identically from the bucket alone.

use crate::common;

use std::collections::BTreeMap;
use std::path::Path;

use weightcast::codec::{apply_delta, read_anchor};
use weightcast::generator::{Generator, GeneratorConfig};
use weightcast::protocol::{ObjectRole, VersionKind, read_manifest, versions_after};
use weightcast::publisher::{Publisher, PublisherConfig};
use weightcast::store::Store;
use weightcast::tensors::TensorSet;

fn cfg(state: &Path, every: u64) -> PublisherConfig {
    common::publisher_config(state, every, None)
}

/// Writes a generator snapshot as a two-shard HF checkpoint with a config.
fn write_checkpoint(dir: &Path, set: &TensorSet, config: &str) {
    std::fs::create_dir_all(dir).unwrap();
    let names: Vec<&str> = set.tensors().iter().map(|t| t.name.as_str()).collect();
    let half = names.len() / 2;
    let mut index = serde_json::Map::new();
    for (shard, part) in [&names[..half], &names[half..]].iter().enumerate() {
        let file = format!("model-{:05}-of-00002.safetensors", shard + 1);
        let items: Vec<_> = part
            .iter()
            .map(|n| {
                let i = set.position(n).unwrap();
                let t = &set.tensors()[i];
                index.insert(n.to_string(), serde_json::Value::String(file.clone()));
                (
                    t.name.clone(),
                    t.dtype,
                    t.shape.clone(),
                    set.data(i).to_vec(),
                )
            })
            .collect();
        let shard_set = TensorSet::from_tensors(items).unwrap();
        let mut f = std::fs::File::create(dir.join(&file)).unwrap();
        shard_set.write_to(&BTreeMap::new(), &mut f).unwrap();
    }
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        serde_json::json!({"weight_map": index}).to_string(),
    )
    .unwrap();
    std::fs::write(dir.join("config.json"), config).unwrap();
}

/// A minimal replayer: newest anchor at or before `version`, then its deltas;
/// returns file name → bytes of every tensor file (as tensor sets) and files.
async fn replay(
    store: &Store,
    version: u64,
) -> (BTreeMap<String, TensorSet>, BTreeMap<String, Vec<u8>>) {
    let m = read_manifest(store, version).await.unwrap().unwrap();
    let mut sets = BTreeMap::new();
    let mut files = BTreeMap::new();
    for v in m.anchor_version..=version {
        let m = read_manifest(store, v).await.unwrap().unwrap();
        assert_eq!(m.kind == VersionKind::Anchor, v == m.anchor_version);
        let objects: Vec<_> = if v == m.anchor_version {
            m.bootstrap_objects().collect()
        } else {
            m.replay_objects().collect()
        };
        for o in objects {
            let body = store.get(&o.key).await.unwrap().unwrap();
            assert_eq!(blake3::hash(&body).to_hex().as_str(), o.blake3);
            match o.role {
                ObjectRole::Anchor => {
                    sets.insert(o.name.clone(), read_anchor(body.to_vec()).unwrap().1);
                }
                ObjectRole::Delta => {
                    let r = apply_delta(sets.get_mut(&o.name).unwrap(), &body).unwrap();
                    assert!(r.verified);
                }
                ObjectRole::File => {
                    files.insert(o.name.clone(), body.to_vec());
                }
            }
        }
    }
    (sets, files)
}

fn same_tensors(a: &TensorSet, b: &TensorSet) -> bool {
    a.len() == b.len()
        && a.tensors().iter().all(|t| {
            let j = b.position(&t.name).unwrap();
            a.data(a.position(&t.name).unwrap()) == b.data(j)
        })
}

/// The mission's bucket layout (issue 12): every anchor object under
/// `anchors/`, every delta object (bridges included) under `deltas/`, the
/// other files under `files/`, and nothing else but the protocol's own keys.
/// Each anchor and delta object describes itself: at least three metadata
/// keys, among them its kind and version, agreeing with its place.
async fn check_layout(store: &Store) {
    let listed = store.list("").await.unwrap();
    let (mut anchors, mut deltas) = (0, 0);
    for l in &listed {
        let top = l.key.split('/').next().unwrap();
        match top {
            "anchors" | "deltas" => {
                let k =
                    weightcast::protocol::layout::parse_object_key(&l.key).unwrap_or_else(|| {
                        panic!("{} is not <prefix>/<version>-<writer>/<file>", l.key)
                    });
                assert!(k.name.ends_with(".safetensors"), "{}", l.key);
                let bytes = store.get(&l.key).await.unwrap().unwrap();
                let (meta, header) = weightcast::codec::inspect(&bytes).unwrap();
                assert!(meta.len() >= 3, "{}: {} metadata keys", l.key, meta.len());
                let h = header.unwrap_or_else(|| panic!("{} has no weightcast header", l.key));
                assert_eq!(h.model_version, k.version, "{}", l.key);
                let want = if top == "anchors" {
                    anchors += 1;
                    weightcast::format::Kind::Anchor
                } else {
                    deltas += 1;
                    weightcast::format::Kind::Delta
                };
                assert_eq!(h.kind, want, "{}", l.key);
                assert_eq!(
                    meta.get("weightcast.kind").map(String::as_str),
                    Some(top.trim_end_matches('s'))
                );
            }
            "files" => assert!(!l.key.ends_with(".safetensors"), "{}", l.key),
            "versions" | "subscribers" | "_weightcast" => {}
            "latest.json" => {}
            other => panic!("unexpected key {} (top-level `{other}`)", l.key),
        }
    }
    assert!(
        anchors >= 2 && deltas >= 2,
        "{anchors} anchors, {deltas} deltas"
    );
}

async fn publisher_suite(store: Store) {
    let work = tempfile::tempdir().unwrap();
    let state = work.path().join("state");
    let mut g = Generator::new(GeneratorConfig::tiny(5));
    let mut truth = Vec::new();

    let mut p = Publisher::open(store.clone(), cfg(&state, 4))
        .await
        .unwrap();
    for v in 0..3u64 {
        if v > 0 {
            g.step();
        }
        let set = g.snapshot();
        let dir = work.path().join(format!("ckpt-{v}"));
        write_checkpoint(&dir, &set, if v < 2 { "{\"a\":1}" } else { "{\"a\":2}" });
        let out = p.publish_path(&dir, &Default::default()).await.unwrap();
        assert_eq!(out.version, v);
        assert_eq!(
            out.kind,
            if v == 0 {
                VersionKind::Anchor
            } else {
                VersionKind::Delta
            }
        );
        assert!(out.bytes > 0 && out.changed > 0 && out.total == set.total_elements());
        truth.push((dir, set));
    }
    // Invisible-until-committed and file handling: v1 did not re-upload the
    // unchanged config, v2 did.
    let m1 = read_manifest(&store, 1).await.unwrap().unwrap();
    assert!(!m1.objects.iter().any(|o| o.name == "config.json"));
    let m2 = read_manifest(&store, 2).await.unwrap().unwrap();
    assert!(
        m2.objects
            .iter()
            .any(|o| o.name == "config.json" && o.role == ObjectRole::File)
    );

    // A restarted publisher continues the chain with a delta.
    drop(p);
    let mut p = Publisher::open(store.clone(), cfg(&state, 4))
        .await
        .unwrap();
    assert_eq!(p.version(), Some(2));
    g.step();
    let set3 = g.snapshot();
    let dir3 = work.path().join("ckpt-3");
    write_checkpoint(&dir3, &set3, "{\"a\":2}");
    let out = p.publish_path(&dir3, &Default::default()).await.unwrap();
    assert_eq!((out.version, out.kind), (3, VersionKind::Delta));
    truth.push((dir3, set3));

    // The policy's "every 4" makes v4 an anchor.
    g.step();
    let set4 = g.snapshot();
    let dir4 = work.path().join("ckpt-4");
    write_checkpoint(&dir4, &set4, "{\"a\":2}");
    let out = p.publish_path(&dir4, &Default::default()).await.unwrap();
    assert_eq!((out.version, out.kind), (4, VersionKind::Anchor));
    assert!(out.anchor_reason.unwrap().contains("every 4"));
    truth.push((dir4, set4));

    check_layout(&store).await;

    // Every version replays bit-identically, shards, index and config included.
    for (v, (dir, set)) in truth.iter().enumerate() {
        let (sets, files) = replay(&store, v as u64).await;
        assert_eq!(sets.len(), 2);
        for (name, replayed) in &sets {
            let original =
                TensorSet::read(&dir.join(name), weightcast::tensors::Digests::Compute).unwrap();
            assert!(same_tensors(replayed, &original), "v{v} {name} differs");
        }
        let total: u64 = sets.values().map(|s| s.total_elements()).sum();
        assert_eq!(total, set.total_elements());
        let cfg_now = std::fs::read(dir.join("config.json")).unwrap();
        assert_eq!(files.get("config.json"), Some(&cfg_now), "v{v} config");
        assert!(files.contains_key("model.safetensors.index.json"));
    }

    // A snapshot that cannot be trusted makes the next version an anchor.
    drop(p);
    let snap = state.join("snapshot");
    let first = std::fs::read_dir(&snap)
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    let mut bytes = std::fs::read(&first).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 1;
    std::fs::write(&first, bytes).unwrap();
    let mut p = Publisher::open(store.clone(), cfg(&state, 100))
        .await
        .unwrap();
    g.step();
    let set5 = g.snapshot();
    let dir5 = work.path().join("ckpt-5");
    write_checkpoint(&dir5, &set5, "{\"a\":2}");
    let out = p.publish_path(&dir5, &Default::default()).await.unwrap();
    assert_eq!((out.version, out.kind), (5, VersionKind::Anchor));

    // A second publisher with its own (stale) state continues after the
    // bucket's newest version, with an anchor.
    let other_state = work.path().join("other-state");
    let mut q = Publisher::open(store.clone(), cfg(&other_state, 100))
        .await
        .unwrap();
    let out = q.publish_path(&dir5, &Default::default()).await.unwrap();
    assert_eq!((out.version, out.kind), (6, VersionKind::Anchor));
    // p's snapshot is now behind the bucket (a foreign commit): p notices,
    // resyncs, and continues after the bucket's newest version with an
    // anchor, then with deltas again — it never writes a delta onto a
    // version it did not make.
    g.step();
    let set7 = g.snapshot();
    let dir7 = work.path().join("ckpt-7");
    write_checkpoint(&dir7, &set7, "{\"a\":2}");
    let out = p.publish_path(&dir7, &Default::default()).await.unwrap();
    assert_eq!((out.version, out.kind), (7, VersionKind::Anchor));
    assert!(out.anchor_reason.unwrap().contains("no trusted snapshot"));
    g.step();
    let set8 = g.snapshot();
    let dir8 = work.path().join("ckpt-8");
    write_checkpoint(&dir8, &set8, "{\"a\":2}");
    let out = p.publish_path(&dir8, &Default::default()).await.unwrap();
    assert_eq!((out.version, out.kind), (8, VersionKind::Delta));
    assert_eq!(
        versions_after(&store, None).await.unwrap(),
        (0..=8).collect::<Vec<_>>()
    );
    let (sets, _) = replay(&store, 8).await;
    for (name, replayed) in &sets {
        let original =
            TensorSet::read(&dir8.join(name), weightcast::tensors::Digests::Compute).unwrap();
        assert!(same_tensors(replayed, &original), "v8 {name} differs");
    }
}

#[tokio::test]
async fn publisher_on_local_filesystem() {
    let (store, _dir) = common::local_store();
    publisher_suite(store).await;
}

#[tokio::test]
async fn publisher_on_s3_moto() {
    let store = common::moto_store("publisher", "run").await;
    publisher_suite(store).await;
}

/// On Garage (conditional writes accepted but not enforced) a publisher
/// refuses to start and says why; declared single-writer, it publishes and a
/// subscriber replays bit-identically.
#[tokio::test]
async fn publisher_refuses_garage_unless_single_writer() {
    let g = common::garage();
    let o = common::garage_options();
    let opts: Vec<(&str, &str)> = o.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let store = Store::open_with(&format!("s3://{}/publisher", g.bucket), &opts).unwrap();
    let work = tempfile::tempdir().unwrap();
    let err = match Publisher::open(store.clone(), cfg(&work.path().join("s"), 4)).await {
        Ok(_) => panic!("publisher accepted a store that ignores conditional writes"),
        Err(e) => e.to_string(),
    };
    assert!(
        err.contains("does not enforce them") && err.contains("--single-writer"),
        "{err}"
    );
    assert!(versions_after(&store, None).await.unwrap().is_empty());

    let mut c = cfg(&work.path().join("s"), 4);
    c.single_writer = true;
    let mut p = Publisher::open(store.clone(), c).await.unwrap();
    let mut gen_ = Generator::new(GeneratorConfig::tiny(11));
    let mut last = None;
    for v in 0..3u64 {
        if v > 0 {
            gen_.step();
        }
        let set = gen_.snapshot();
        let dir = work.path().join(format!("ckpt-{v}"));
        write_checkpoint(&dir, &set, "{}");
        assert_eq!(
            p.publish_path(&dir, &Default::default())
                .await
                .unwrap()
                .version,
            v
        );
        last = Some((dir, set));
    }
    let (dir, _) = last.unwrap();
    let (sets, _) = replay(&store, 2).await;
    for (name, replayed) in &sets {
        let original =
            TensorSet::read(&dir.join(name), weightcast::tensors::Digests::Compute).unwrap();
        assert!(same_tensors(replayed, &original), "{name} differs");
    }
}

/// A checkpoint without tensors is refused naming it; a tensor set unrelated
/// to the last version (other names) is published as an anchor, never as a
/// delta against weights it has nothing to do with.
#[tokio::test]
async fn empty_or_unrelated_tensor_sets_are_never_deltas() {
    let (store, _bucket) = common::local_store();
    let work = tempfile::tempdir().unwrap();
    let mut p = Publisher::open(store.clone(), cfg(&work.path().join("state"), 100))
        .await
        .unwrap();
    let empty = work.path().join("empty");
    let none: Vec<(String, weightcast::dtype::Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    write_checkpoint(&empty, &TensorSet::from_tensors(none).unwrap(), "{}");
    let e = p
        .publish_path(&empty, &Default::default())
        .await
        .unwrap_err();
    assert_eq!(e.kind(), weightcast::error::ErrorKind::BadRequest, "{e}");
    assert!(e.to_string().contains("no tensors"), "{e}");
    assert!(versions_after(&store, None).await.unwrap().is_empty());

    let mut g = Generator::new(GeneratorConfig::tiny(5));
    let a = work.path().join("a");
    write_checkpoint(&a, &g.snapshot(), "{}");
    assert_eq!(
        p.publish_path(&a, &Default::default())
            .await
            .unwrap()
            .version,
        0
    );
    g.step();
    // Same weights under other names: structurally unrelated.
    let s = g.snapshot();
    let renamed = TensorSet::from_tensors(
        s.tensors()
            .iter()
            .enumerate()
            .map(|(i, t)| {
                (
                    format!("other.{}", t.name),
                    t.dtype,
                    t.shape.clone(),
                    s.data(i).to_vec(),
                )
            })
            .collect::<Vec<_>>(),
    )
    .unwrap();
    let b = work.path().join("b");
    write_checkpoint(&b, &renamed, "{}");
    let out = p.publish_path(&b, &Default::default()).await.unwrap();
    assert_eq!(out.version, 1);
    let m = read_manifest(&store, 1).await.unwrap().unwrap();
    assert_eq!(m.kind, VersionKind::Anchor, "{m:?}");
}

/// A buffer a caller lends (as the Python package lends a tensor's
/// storage) that the trainer writes while the publisher reads it, made
/// deterministic: its first `reads` reads see `before`, every later one
/// `after`. Both have the same length.
struct Racy {
    before: Vec<u8>,
    after: Vec<u8>,
    reads: usize,
    seen: std::sync::atomic::AtomicUsize,
}

impl weightcast::tensors::ExternalBuffer for Racy {
    fn bytes(&self) -> &[u8] {
        let n = self.seen.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        if n < self.reads {
            &self.before
        } else {
            &self.after
        }
    }
    fn bytes_mut(&mut self) -> Option<&mut [u8]> {
        None
    }
}

/// An in-memory checkpoint over [`Racy`] buffers: `before` on each tensor's
/// first read, `after` from then on.
fn racy_checkpoint(
    before: &TensorSet,
    after: &TensorSet,
    config: &[u8],
) -> weightcast::publisher::Checkpoint {
    let set = TensorSet::from_external(before.tensors().iter().enumerate().map(|(i, t)| {
        let j = after.position(&t.name).unwrap();
        let buf: Box<dyn weightcast::tensors::ExternalBuffer> = Box::new(Racy {
            before: before.data(i).to_vec(),
            after: after.data(j).to_vec(),
            // `from_external` reads it once, for its length.
            reads: 2,
            seen: Default::default(),
        });
        (t.name.clone(), t.dtype, t.shape.clone(), buf)
    }))
    .unwrap();
    weightcast::publisher::Checkpoint::from_sets(
        [("model.safetensors".to_string(), set)].into(),
        [(
            "config.json".to_string(),
            bytes::Bytes::copy_from_slice(config),
        )]
        .into(),
    )
    .unwrap()
}

/// Issue 30, defect 6: a checkpoint whose lent buffers change while it is
/// being published. The anchor and the digests recorded for it used to come
/// from different reads (the digests from the first, the snapshot and the
/// object from the next), so the snapshot's digests stopped describing its
/// bytes: every later version failed its subscribers' integrity checks while
/// `publish` reported success, until the process restarted. Now an anchor
/// is made from the snapshot file it writes (one read: whatever the buffers
/// held then, exactly), and a bridged anchor whose bridges were diffed from
/// other bytes is refused and followed by a verified anchor. After every
/// successful publish a fresh subscriber holds that version exactly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkpoint_written_during_its_publish_never_poisons_the_publisher() {
    let (store, _bucket) = common::local_store();
    let work = tempfile::tempdir().unwrap();
    let mut p = Publisher::open(store.clone(), cfg(&work.path().join("state"), 3))
        .await
        .unwrap();
    let fresh = |version: u64, weights: TensorSet, config: Vec<u8>, what: &'static str| {
        let store = store.clone();
        async move {
            let out = tempfile::tempdir().unwrap();
            let c = weightcast::subscriber::catch_up(&store, out.path())
                .await
                .unwrap_or_else(|e| panic!("{what}: {e}"))
                .unwrap_or_else(|| panic!("{what}: no version"));
            assert_eq!(c.version, version, "{what}: {c:?}");
            common::assert_replica(out.path(), &weights, &config, what);
        }
    };
    let mut t = common::Trainer::new(41);
    let opts = weightcast::publisher::PublishOptions::default();

    // Version 0, an anchor: the trainer writes its next step into the
    // buffers after the publisher's first read of them.
    let (before, config) = (t.weights(), t.config());
    t.step();
    let out = p
        .publish(racy_checkpoint(&before, &t.weights(), &config), &opts)
        .await
        .unwrap();
    assert_eq!((out.version, out.kind), (0, VersionKind::Anchor));
    fresh(0, before, config, "an anchor read while written").await;

    // Versions 1 and 2: deltas of still checkpoints.
    for v in 1..3u64 {
        if v > 1 {
            t.step();
        }
        let out = p.publish(t.checkpoint(), &opts).await.unwrap();
        assert_eq!((out.version, out.kind), (v, VersionKind::Delta));
        fresh(v, t.weights(), t.config(), "a delta after it").await;
    }

    // Version 3, the scheduled anchor with bridges: the bridges are diffed
    // from the buffers' first bytes, the snapshot would be written from the
    // next. Refused; nothing is committed.
    t.step();
    let (before, config) = (t.weights(), t.config());
    t.step();
    let e = p
        .publish(racy_checkpoint(&before, &t.weights(), &config), &opts)
        .await
        .expect_err("bridges diffed from other bytes than the anchor's");
    assert_eq!(e.kind(), weightcast::error::ErrorKind::Precondition, "{e}");
    assert!(
        e.to_string()
            .contains("changed while it was being published"),
        "{e}"
    );
    assert_eq!(versions_after(&store, None).await.unwrap(), vec![0, 1, 2]);

    // The next version is an anchor from a full read, and every version
    // after it is exact.
    let out = p.publish(t.checkpoint(), &opts).await.unwrap();
    assert_eq!((out.version, out.kind), (3, VersionKind::Anchor), "{out:?}");
    assert!(
        out.anchor_reason
            .as_deref()
            .is_some_and(|r| r.contains("no trusted snapshot")),
        "{out:?}"
    );
    fresh(3, t.weights(), t.config(), "the anchor after a refusal").await;
    t.step();
    let out = p.publish(t.checkpoint(), &opts).await.unwrap();
    assert_eq!((out.version, out.kind), (4, VersionKind::Delta));
    fresh(4, t.weights(), t.config(), "a delta after that anchor").await;
}

/// Per tensor of `a`: the word indices where `b` differs and `b`'s words there.
fn diff_words(a: &TensorSet, b: &TensorSet) -> Vec<(String, Vec<u64>, Vec<u8>)> {
    a.tensors()
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let wb = weightcast::dtype::word_bytes(t.dtype);
            let j = b.position(&t.name).unwrap();
            let (x, y) = (a.data(i), b.data(j));
            let (mut pos, mut new) = (Vec::new(), Vec::new());
            for (k, (p, q)) in x.chunks(wb).zip(y.chunks(wb)).enumerate() {
                if p != q {
                    pos.push(k as u64);
                    new.extend_from_slice(q);
                }
            }
            (t.name.clone(), pos, new)
        })
        .collect()
}

fn as_changes<'a>(
    set: &TensorSet,
    diff: &'a [(String, Vec<u64>, Vec<u8>)],
) -> weightcast::publisher::Changes<'a> {
    let tensors = diff
        .iter()
        .map(|(name, pos, new)| {
            let t = &set.tensors()[set.position(name).unwrap()];
            weightcast::publisher::ChangedTensor {
                name: name.clone(),
                dtype: t.dtype,
                shape: t.shape.clone(),
                positions: weightcast::codec::compact::PositionSlice::U64(pos),
                new,
            }
        })
        .collect();
    weightcast::publisher::Changes {
        tensor_files: BTreeMap::from([("weights.safetensors".to_string(), tensors)]),
        files: BTreeMap::new(),
    }
}

/// A trainer that compared versions on its GPU publishes only the changes:
/// the versions replay bit-identically from the bucket, interleave with full
/// publishes, and whatever a delta of those changes cannot be (an anchor
/// due, changes found against another state, another structure) writes
/// nothing and asks for the full tensors.
#[tokio::test]
async fn changes_found_by_the_trainer_publish_the_same_versions() {
    use weightcast::publisher::{ChangesOutcome, Checkpoint};
    let (store, _bucket) = common::local_store();
    let work = tempfile::tempdir().unwrap();
    let mut p = Publisher::open(store.clone(), cfg(&work.path().join("state"), 4))
        .await
        .unwrap();
    let full = |set: &TensorSet| {
        Checkpoint::from_sets(
            BTreeMap::from([("weights.safetensors".to_string(), set.clone())]),
            BTreeMap::new(),
        )
        .unwrap()
    };
    let mut g = Generator::new(GeneratorConfig::tiny(7));
    let mut prev = g.snapshot();
    let nothing = diff_words(&prev, &prev);
    match p
        .publish_changes(as_changes(&prev, &nothing), &Default::default())
        .await
        .unwrap()
    {
        ChangesOutcome::NeedsFull(why) => assert!(why.contains("no trusted snapshot"), "{why}"),
        other => panic!("a first version from changes: {other:?}"),
    }
    p.publish(full(&prev), &Default::default()).await.unwrap();
    // (One file is published as `model.safetensors`, whatever its name.)
    for v in 1..=5u64 {
        g.step();
        let now = g.snapshot();
        let diff = diff_words(&prev, &now);
        let out = p
            .publish_changes(as_changes(&prev, &diff), &Default::default())
            .await
            .unwrap();
        match out {
            ChangesOutcome::Published(pb) => {
                assert_ne!(v, 4, "version 4 is an anchor by the cadence");
                assert_eq!((pb.version, pb.kind), (v, VersionKind::Delta));
                let changed: u64 = diff.iter().map(|d| d.1.len() as u64).sum();
                assert_eq!(pb.changed, changed);
            }
            ChangesOutcome::NeedsFull(why) => {
                assert_eq!(v, 4, "{why}");
                assert!(why.contains("every 4 versions"), "{why}");
                // nothing was written
                assert_eq!(newest(&store).await, 3);
                let pb = p.publish(full(&now), &Default::default()).await.unwrap();
                assert_eq!((pb.version, pb.kind), (4, VersionKind::Anchor));
            }
        }
        let (sets, _) = replay(&store, v).await;
        assert!(
            same_tensors(&sets["model.safetensors"], &now),
            "version {v}"
        );
        prev = now;
    }
    // A full publish after a version of changes diffs against the snapshot
    // those changes advanced.
    g.step();
    let now = g.snapshot();
    let pb = p.publish(full(&now), &Default::default()).await.unwrap();
    assert_eq!((pb.version, pb.kind), (6, VersionKind::Delta));
    assert!(same_tensors(
        &replay(&store, 6).await.0["model.safetensors"],
        &now
    ));

    // Changes found against another state (version 5's changes again): the
    // listed words are already the snapshot's; nothing is written.
    let stale = diff_words(&prev, &now);
    match p
        .publish_changes(as_changes(&prev, &stale), &Default::default())
        .await
        .unwrap()
    {
        ChangesOutcome::NeedsFull(why) => {
            assert!(why.contains("not found against version 6"), "{why}")
        }
        other => panic!("stale changes published: {other:?}"),
    }
    assert_eq!(newest(&store).await, 6);
    // No changes: the version is unchanged.
    let none: Vec<_> = stale
        .iter()
        .map(|(n, _, _)| (n.clone(), Vec::new(), Vec::new()))
        .collect();
    match p
        .publish_changes(as_changes(&now, &none), &Default::default())
        .await
        .unwrap()
    {
        ChangesOutcome::Published(pb) => assert!(pb.unchanged && pb.version == 6),
        other => panic!("{other:?}"),
    }
    // Another structure (a tensor missing), malformed changes: refused.
    let fewer = &none[1..];
    assert!(matches!(
        p.publish_changes(as_changes(&now, fewer), &Default::default()).await.unwrap(),
        ChangesOutcome::NeedsFull(why) if why.contains("tensors given")
    ));
    g.step();
    let next = g.snapshot();
    let mut bad = diff_words(&now, &next);
    let k = bad.iter().position(|d| d.1.len() > 2).unwrap();
    bad[k].1.swap(0, 1);
    let e = p
        .publish_changes(as_changes(&now, &bad), &Default::default())
        .await
        .unwrap_err();
    assert_eq!(e.kind(), weightcast::error::ErrorKind::BadRequest, "{e}");
    assert!(
        e.to_string().contains(&bad[k].0) && e.to_string().contains("ascending"),
        "{e}"
    );
    assert_eq!(newest(&store).await, 6);
    // And the good changes still publish.
    let good = diff_words(&now, &next);
    let out = p
        .publish_changes(as_changes(&now, &good), &Default::default())
        .await
        .unwrap();
    assert!(
        matches!(out, ChangesOutcome::Published(ref pb) if pb.version == 7),
        "{out:?}"
    );
    assert!(same_tensors(
        &replay(&store, 7).await.0["model.safetensors"],
        &next
    ));
}

async fn newest(store: &Store) -> u64 {
    weightcast::protocol::newest_version(store)
        .await
        .unwrap()
        .unwrap()
}

/// Writes at `dir` a sharded checkpoint of four files: three of 2.5 upload
/// parts of random 16-bit words (stored raw in a `planes` anchor: three
/// parts, the middle one sent while the object is written) and one of a few
/// KB. Returns file name → tensors.
pub fn large_sharded_checkpoint(dir: &Path, seed: u64) -> BTreeMap<String, TensorSet> {
    std::fs::create_dir_all(dir).unwrap();
    let part = weightcast::store::PART_SIZE;
    let mut x = 0x9E37_79B9_7F4A_7C15u64 ^ seed;
    let mut index = serde_json::Map::new();
    let mut truth = BTreeMap::new();
    for (k, words) in [part * 5 / 4, part * 5 / 4, 2_000, part * 5 / 4]
        .into_iter()
        .enumerate()
    {
        let data: Vec<u8> = (0..words)
            .flat_map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x as u16).to_le_bytes()
            })
            .collect();
        let name = format!("w{k}");
        let file = format!("model-{:05}-of-00004.safetensors", k + 1);
        index.insert(name.clone(), serde_json::Value::String(file.clone()));
        let set = TensorSet::from_tensors(vec![(
            name,
            weightcast::dtype::Dtype::BF16,
            vec![words],
            data,
        )])
        .unwrap();
        let mut f = std::fs::File::create(dir.join(&file)).unwrap();
        set.write_to(&BTreeMap::new(), &mut f).unwrap();
        truth.insert(file, set);
    }
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        serde_json::json!({"weight_map": index}).to_string(),
    )
    .unwrap();
    truth
}

/// Checks that version `v` of `store` is an anchor of `truth`'s files, in
/// file order, three of them larger than two parts, that replays exactly.
pub async fn check_large_anchor(store: &Store, v: u64, truth: &BTreeMap<String, TensorSet>) {
    let part = weightcast::store::PART_SIZE;
    let m = read_manifest(store, v).await.unwrap().unwrap();
    assert_eq!(m.kind, VersionKind::Anchor);
    let anchors: Vec<_> = m
        .objects
        .iter()
        .filter(|o| o.role == ObjectRole::Anchor)
        .collect();
    let names: Vec<&str> = anchors.iter().map(|o| o.name.as_str()).collect();
    let files: Vec<&str> = truth.keys().map(String::as_str).collect();
    assert_eq!(names, files, "anchor objects in file order");
    let large = anchors.iter().filter(|o| o.size > 2 * part as u64).count();
    assert_eq!(large, 3, "three objects of more than two parts");
    let (sets, _) = replay(store, v).await;
    assert_eq!(sets.len(), truth.len());
    for (file, set) in truth {
        assert!(same_tensors(&sets[file], set), "{file} differs");
    }
}

/// An anchor of several files, each of several upload parts, on S3: every
/// object streams while it is compressed, two at once through one part
/// budget (`Store::put_growing`: part uploads, not whole objects), and each
/// is recorded in file order and replays bit-identically (one small file
/// among them goes up whole).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anchor_files_of_several_parts_all_stream_and_replay() {
    let store = common::moto_store("publisher", "streamed").await;
    let work = tempfile::tempdir().unwrap();
    let dir = work.path().join("ckpt");
    let truth = large_sharded_checkpoint(&dir, 0);
    let mut p = Publisher::open(store.clone(), cfg(&work.path().join("state"), 4))
        .await
        .unwrap();
    let out = p.publish_path(&dir, &Default::default()).await.unwrap();
    assert_eq!((out.version, out.kind), (0, VersionKind::Anchor));
    check_large_anchor(&store, 0, &truth).await;

    // A subscriber into a directory whose fetcher takes these objects in
    // 1 MiB ranged parts: each `planes` object is decoded while it downloads
    // (`Fetcher::anchor_to_file`), and the replica is exact.
    use weightcast::subscriber::{DirSink, Fetcher, Subscriber, source::VersionSource};
    let mut f = Fetcher::new(store.clone());
    f.large_object = 1 << 20;
    f.part_size = 1 << 20;
    let o = work.path().join("sub");
    std::fs::create_dir_all(&o).unwrap();
    let mut sub = Subscriber::new(
        f,
        VersionSource::new(std::time::Duration::from_secs(1), 0.0),
        DirSink::open(&o, 2).unwrap(),
    );
    let c = sub.catch_up(true).await.unwrap().unwrap();
    assert_eq!((c.version, c.from_anchor), (0, true));
    drop(sub);
    for (file, set) in &truth {
        let got = TensorSet::read(
            &o.join("current").join(file),
            weightcast::tensors::Digests::Compute,
        )
        .unwrap();
        assert!(same_tensors(&got, set), "replica {file} differs");
    }
    let mut dirs = vec![o.clone()];
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                dirs.push(p);
            } else {
                let n = p.to_string_lossy().into_owned();
                assert!(
                    !n.ends_with(".raw") && !n.ends_with(".download"),
                    "left behind: {n}"
                );
            }
        }
    }
}
