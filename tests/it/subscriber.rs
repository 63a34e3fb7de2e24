//! Publisher → bucket → subscribers, on real stores: subscribers at different
//! lags converge bit-identically; corrupt or missing objects are repaired from
//! an anchor or refused, never materialized.

use crate::common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use bytes::Bytes;
use weightcast::generator::{Generator, GeneratorConfig};
use weightcast::protocol::{ObjectRole, read_manifest};
use weightcast::publisher::Publisher;
use weightcast::store::Store;
use weightcast::subscriber::catch_up;
use weightcast::tensors::{Digests, TensorSet};

struct Trainer {
    g: Generator,
    work: PathBuf,
    publisher: Publisher,
    published: Vec<PathBuf>,
}

impl Trainer {
    async fn new(store: &Store, work: &Path, every: u64) -> Trainer {
        let cfg = common::publisher_config(&work.join("pub-state"), every, None);
        Trainer {
            g: Generator::new(GeneratorConfig::tiny(9)),
            work: work.to_path_buf(),
            publisher: Publisher::open(store.clone(), cfg).await.unwrap(),
            published: Vec::new(),
        }
    }

    /// One training step, published; returns the checkpoint file.
    async fn step(&mut self) -> PathBuf {
        if !self.published.is_empty() {
            self.g.step();
        }
        let v = self.published.len();
        let dir = self.work.join(format!("ckpt-{v}"));
        std::fs::create_dir_all(&dir).unwrap();
        let mut f = std::fs::File::create(dir.join("model.safetensors")).unwrap();
        self.g
            .snapshot()
            .write_to(&BTreeMap::new(), &mut f)
            .unwrap();
        std::fs::write(dir.join("config.json"), format!("{{\"step\": {}}}", v / 3)).unwrap();
        self.publisher
            .publish_path(&dir, &Default::default())
            .await
            .unwrap();
        self.published.push(dir.clone());
        dir
    }
}

/// The subscriber's current checkpoint equals the trainer's files byte for byte
/// in every tensor, and the config matches.
fn assert_matches(out: &Path, ckpt: &Path) {
    let cur = out.join("current");
    let got = TensorSet::read(&cur.join("model.safetensors"), Digests::Compute).unwrap();
    let want = TensorSet::read(&ckpt.join("model.safetensors"), Digests::Compute).unwrap();
    assert_eq!(got.len(), want.len());
    for (i, t) in want.tensors().iter().enumerate() {
        let j = got.position(&t.name).unwrap();
        assert!(got.data(j) == want.data(i), "{} differs", t.name);
    }
    assert_eq!(got.digest(), want.digest());
    assert_eq!(
        std::fs::read(cur.join("config.json")).unwrap(),
        std::fs::read(ckpt.join("config.json")).unwrap()
    );
}

async fn suite(store: Store) {
    let work = tempfile::tempdir().unwrap();
    let mut t = Trainer::new(&store, work.path(), 6).await;
    let early = work.path().join("sub-early");
    let lagging = work.path().join("sub-lagging");

    // Nothing published yet.
    assert!(catch_up(&store, &early).await.unwrap().is_none());

    t.step().await; // v0 anchor
    let c = catch_up(&store, &early).await.unwrap().unwrap();
    assert!(c.from_anchor && c.version == 0);
    assert_matches(&early, &t.published[0]);

    // The early subscriber follows every version by deltas.
    for v in 1..=3u64 {
        let ckpt = t.step().await;
        let c = catch_up(&store, &early).await.unwrap().unwrap();
        assert_eq!((c.version, c.deltas_applied, c.from_anchor), (v, 1, false));
        assert_matches(&early, &ckpt);
        // The output alternates between its two slots.
        let slot = if v % 2 == 1 { "slots/b" } else { "slots/a" };
        assert_eq!(
            std::fs::read_link(early.join("current")).unwrap(),
            Path::new(slot),
            "{c:?}"
        );
    }
    // Polling with nothing new downloads nothing.
    assert_eq!(
        catch_up(&store, &early).await.unwrap().unwrap().downloaded,
        0
    );

    // v4, v5 deltas, v6 an anchor (every 6), v7 a delta. A late joiner starts
    // at the anchor.
    for _ in 4..=7 {
        t.step().await;
    }
    let c = catch_up(&store, &lagging).await.unwrap().unwrap();
    assert_eq!((c.version, c.from_anchor, c.deltas_applied), (7, true, 1));
    assert_matches(&lagging, &t.published[7]);
    // The early subscriber (at v3) is behind the anchor at v6: replaying four
    // deltas (v6's bridge among them) is cheaper than the anchor, so it does.
    let c = catch_up(&store, &early).await.unwrap().unwrap();
    assert_eq!((c.version, c.from_anchor, c.deltas_applied), (7, false, 4));
    assert_matches(&early, &t.published[7]);

    // A restarted subscriber continues from its verified local state.
    t.step().await; // v8
    let c = catch_up(&store, &lagging).await.unwrap().unwrap();
    assert_eq!((c.version, c.deltas_applied, c.from_anchor), (8, 1, false));

    // A corrupted delta in the bucket: replay from local state fails, the
    // subscriber repairs from the anchor... whose chain contains the same
    // corrupt object, so it refuses — and keeps serving v8 untouched.
    t.step().await; // v9
    let m9 = read_manifest(&store, 9).await.unwrap().unwrap();
    let delta = m9
        .objects
        .iter()
        .find(|o| o.role == ObjectRole::Delta)
        .unwrap();
    let original = store.get(&delta.key).await.unwrap().unwrap();
    let mut bad = original.to_vec();
    let mid = bad.len() - 3;
    bad[mid] ^= 0x10;
    store.put(&delta.key, Bytes::from(bad)).await.unwrap();
    // Quarantined: version 8 stays, 9 is reported with the reason.
    let quarantined = |c: Option<weightcast::subscriber::CaughtUp>| {
        let c = c.expect("a version is held");
        assert_eq!(c.version, 8, "{c:?}");
        assert_eq!(c.quarantined.len(), 1, "{c:?}");
        assert_eq!(c.quarantined[0].version, 9, "{c:?}");
        c.quarantined[0].error.clone()
    };
    let err = quarantined(catch_up(&store, &lagging).await.unwrap());
    assert!(
        err.contains("integrity") && err.contains(&delta.key),
        "{err}"
    );
    assert_matches(&lagging, &t.published[8]);

    // A deleted delta is refused the same way.
    store.put(&delta.key, original.clone()).await.unwrap();
    store.delete(&delta.key).await.unwrap();
    let err = quarantined(catch_up(&store, &lagging).await.unwrap());
    assert!(err.contains("missing"), "{err}");
    assert_matches(&lagging, &t.published[8]);

    // Restored: it catches up.
    store.put(&delta.key, original).await.unwrap();
    let c = catch_up(&store, &lagging).await.unwrap().unwrap();
    assert_eq!(c.version, 9);
    assert_matches(&lagging, &t.published[9]);

    // Local corruption of the output files: detected by the next catch-up
    // (which verifies the current slot first), repaired from the anchor.
    t.step().await; // v10
    let f = lagging.join("current/model.safetensors");
    let mut bytes = std::fs::read(&f).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 1;
    std::fs::write(&f, bytes).unwrap();
    let c = catch_up(&store, &lagging).await.unwrap().unwrap();
    assert_eq!(c.version, 10);
    assert!(c.from_anchor);
    assert_matches(&lagging, &t.published[10]);
}

#[tokio::test]
async fn subscribers_on_local_filesystem() {
    let (store, _dir) = common::local_store();
    suite(store).await;
}

#[tokio::test]
async fn subscribers_on_s3_moto() {
    let store = common::moto_store("subscriber", "run").await;
    suite(store).await;
}

/// An idle `--once` (nothing new in the bucket) still verifies its output:
/// damage to the current slot is found and repaired from the anchor into the
/// other slot, while the damaged slot is never written. Idle polls cost a
/// handful of store requests. A bucket whose held version vanished (reset,
/// collected) is followed back.
#[tokio::test]
async fn an_idle_once_verifies_and_repairs_its_output() {
    let (store, _dir) = common::local_store();
    let work = tempfile::tempdir().unwrap();
    let mut t = Trainer::new(&store, work.path(), 100).await;
    let out = work.path().join("sub");
    t.step().await;
    t.step().await;
    let c = catch_up(&store, &out).await.unwrap().unwrap();
    assert_eq!(c.version, 1);
    let damaged_slot = std::fs::read_link(out.join("current")).unwrap();

    // Idle and intact: nothing downloaded, nothing repaired, a few requests
    // (a listing after the held version and its manifest).
    let c = catch_up(&store, &out).await.unwrap().unwrap();
    assert_eq!((c.version, c.downloaded, c.repairs), (1, 0, 0), "{c:?}");
    assert!(c.requests <= 3, "{c:?}");

    // Damage one byte of the current output in place.
    let model = out.join("current/model.safetensors");
    let mut bytes = std::fs::read(&model).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0x01;
    std::fs::write(&model, &bytes).unwrap();

    // Idle, but the output is checked: repaired from the anchor, into the
    // other slot; the damaged slot was not written.
    let c = catch_up(&store, &out).await.unwrap().unwrap();
    assert_eq!((c.version, c.from_anchor, c.repairs), (1, true, 1), "{c:?}");
    assert_eq!(c.previous, None, "{c:?}");
    assert_matches(&out, &t.published[1]);
    let now = std::fs::read_link(out.join("current")).unwrap();
    assert_ne!(now, damaged_slot);
    assert_eq!(
        std::fs::read(out.join(&damaged_slot).join("model.safetensors")).unwrap(),
        bytes
    );

    // The next version rebuilds the damaged slot (a clone of the current
    // one) before patching it.
    let ckpt = t.step().await;
    let c = catch_up(&store, &out).await.unwrap().unwrap();
    assert_eq!(
        (c.version, c.from_anchor, c.deltas_applied),
        (2, false, 1),
        "{c:?}"
    );
    assert!(c.cloned_bytes > 0 || c.journal_bytes == 0, "{c:?}");
    assert_matches(&out, &ckpt);

    // The held version's manifest vanishing sends it back to the bucket's newest.
    std::fs::remove_file(_dir.path().join(weightcast::protocol::manifest_key(2))).unwrap();
    let c = catch_up(&store, &out).await.unwrap().unwrap();
    assert_eq!(c.version, 1, "{c:?}");
    assert_matches(&out, &t.published[1]);
}

/// Objects larger than the part size come down as concurrent ranged GETs and
/// verify; a corrupted large object is refused, and nothing of it remains.
async fn ranged_downloads(store: Store) {
    use weightcast::protocol::ObjectEntry;
    use weightcast::subscriber::Fetcher;
    let body: Vec<u8> = (0..(5 << 20) + 12345u32)
        .map(|i| (i * 7 % 251) as u8)
        .collect();
    store
        .put("big/object", Bytes::from(body.clone()))
        .await
        .unwrap();
    let entry = ObjectEntry {
        name: "model.safetensors".into(),
        role: ObjectRole::Anchor,
        key: "big/object".into(),
        size: body.len() as u64,
        blake3: blake3::hash(&body).to_hex().to_string(),
    };
    let mut f = Fetcher::new(store.clone());
    f.large_object = 1 << 20;
    f.part_size = 1 << 20;
    f.parts_in_flight = 3;
    // The store's own ranged read and size, for the record.
    assert_eq!(
        store.head("big/object").await.unwrap(),
        Some(body.len() as u64)
    );
    assert_eq!(store.head("big/none").await.unwrap(), None);
    let mid = store.get_range("big/object", 1000..3000).await.unwrap();
    assert_eq!(&mid[..], &body[1000..3000]);
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("download");
    f.to_file(&entry, &file).await.unwrap();
    assert_eq!(std::fs::read(&file).unwrap(), body);
    // Six parts, one request each.
    assert_eq!(f.requests(), 6);
    // Into memory, the same way.
    assert_eq!(f.bytes(&entry).await.unwrap().to_vec(), body);
    assert_eq!(f.requests(), 12);

    // One flipped byte in the store: refused, named, and the file removed.
    let mut bad = body.clone();
    bad[3 << 20] ^= 0x40;
    store.put("big/object", Bytes::from(bad)).await.unwrap();
    let err = f.to_file(&entry, &file).await.unwrap_err().to_string();
    assert!(
        err.contains("big/object") && err.contains("integrity"),
        "{err}"
    );
    assert!(!file.exists());
    // A shorter object: refused too.
    store
        .put("big/object", Bytes::from(body[..body.len() - 10].to_vec()))
        .await
        .unwrap();
    let err = f.to_file(&entry, &file).await.unwrap_err().to_string();
    assert!(err.contains("big/object"), "{err}");
    // A missing one names the key and the store.
    store.delete("big/object").await.unwrap();
    let err = f.to_file(&entry, &file).await.unwrap_err().to_string();
    assert!(
        err.contains("big/object") && err.contains(store.url()),
        "{err}"
    );

    // A `planes` anchor of several parts is decoded while it downloads: the
    // file is the raw anchor, whose layout comes back; a raw anchor comes as
    // it is; a corrupted one is refused and nothing of it remains.
    let mut g = Generator::new(GeneratorConfig::with_elements(3, 3 << 20));
    g.step();
    let set = g.snapshot();
    let (raw, _) = weightcast::codec::encode_anchor(&set, 5).unwrap();
    let (packed, _) = weightcast::codec::encode_anchor_compressed(&set, 5).unwrap();
    assert!(packed.len() > 3 << 20, "{} bytes", packed.len());
    let put = |key: &str, body: &[u8]| {
        let (store, key, body) = (store.clone(), key.to_string(), body.to_vec());
        async move {
            store.put(&key, Bytes::from(body.clone())).await.unwrap();
            ObjectEntry {
                name: "model.safetensors".into(),
                role: ObjectRole::Anchor,
                key,
                size: body.len() as u64,
                blake3: blake3::hash(&body).to_hex().to_string(),
            }
        }
    };
    let e = put("big/planes", &packed).await;
    let layout = f.anchor_to_file(&e, &file).await.unwrap();
    assert!(layout.is_some(), "decoded while it downloaded");
    assert!(std::fs::read(&file).unwrap() == raw, "not the raw anchor");
    let e = put("big/raw", &raw).await;
    assert!(f.anchor_to_file(&e, &file).await.unwrap().is_none());
    assert!(std::fs::read(&file).unwrap() == raw);
    let mut bad = packed.clone();
    let at = bad.len() - 1000;
    bad[at] ^= 0x10;
    let mut e = put("big/planes", &bad).await;
    e.blake3 = blake3::hash(&packed).to_hex().to_string();
    let err = f.anchor_to_file(&e, &file).await.unwrap_err().to_string();
    assert!(
        err.contains("big/planes") && err.contains("integrity"),
        "{err}"
    );
    assert!(!file.exists() && !file.with_extension("raw").exists());
}

#[tokio::test]
async fn ranged_downloads_on_local_filesystem() {
    let (store, _dir) = common::local_store();
    ranged_downloads(store).await;
}

#[tokio::test]
async fn ranged_downloads_on_s3_moto() {
    ranged_downloads(common::moto_store("subscriber-ranges", "run").await).await;
}

/// A checkpoint of several tensor files: its anchor objects download while
/// the ones before them are decoded (the bootstrap pipeline), and the output
/// is bit-identical. A corrupted object in the middle of the pipeline is
/// refused by name, the downloads after it are dropped, and nothing of the
/// update remains in the output.
async fn pipelined_bootstrap(store: Store) {
    let work = tempfile::tempdir().unwrap();
    let ckpt = work.path().join("ckpt");
    std::fs::create_dir_all(&ckpt).unwrap();
    let files: Vec<String> = (1..=5)
        .map(|i| format!("model-{i:05}-of-00005.safetensors"))
        .collect();
    for (i, name) in files.iter().enumerate() {
        let mut f = std::fs::File::create(ckpt.join(name)).unwrap();
        Generator::new(GeneratorConfig::tiny(100 + i as u64))
            .snapshot()
            .write_to(&BTreeMap::new(), &mut f)
            .unwrap();
    }
    std::fs::write(ckpt.join("config.json"), "{\"step\": 0}").unwrap();
    let cfg = common::publisher_config(&work.path().join("pub-state"), 10, None);
    let mut publisher = Publisher::open(store.clone(), cfg).await.unwrap();
    publisher
        .publish_path(&ckpt, &Default::default())
        .await
        .unwrap();
    let m = read_manifest(&store, 0).await.unwrap().unwrap();
    let anchors: Vec<_> = m
        .objects
        .iter()
        .filter(|o| o.role == ObjectRole::Anchor)
        .collect();
    assert_eq!(anchors.len(), files.len(), "{m:?}");

    let out = work.path().join("sub");
    let c = catch_up(&store, &out).await.unwrap().unwrap();
    assert!(c.from_anchor, "{c:?}");
    for name in &files {
        let got = TensorSet::read(&out.join("current").join(name), Digests::Compute).unwrap();
        let want = TensorSet::read(&ckpt.join(name), Digests::Compute).unwrap();
        assert_eq!(got.digest(), want.digest(), "{name}");
        for (i, t) in want.tensors().iter().enumerate() {
            let j = got.position(&t.name).unwrap();
            assert!(got.data(j) == want.data(i), "{name}: {} differs", t.name);
        }
    }

    // The third anchor object corrupted: a fresh subscriber refuses it.
    let bad = anchors[2];
    let mut body = store.get(&bad.key).await.unwrap().unwrap().to_vec();
    let at = body.len() / 2;
    body[at] ^= 0x10;
    store.put(&bad.key, Bytes::from(body)).await.unwrap();
    let fresh = work.path().join("sub-fresh");
    let err = catch_up(&store, &fresh).await.unwrap_err().to_string();
    assert!(err.contains(&bad.key), "{err}");
    assert!(!fresh.join("current").exists());
    assert!(!fresh.join(".tmp").exists(), "a download was left behind");
}

#[tokio::test]
async fn pipelined_bootstrap_on_local_filesystem() {
    let (store, _dir) = common::local_store();
    pipelined_bootstrap(store).await;
}

#[tokio::test]
async fn pipelined_bootstrap_on_s3_moto() {
    pipelined_bootstrap(common::moto_store("subscriber-pipeline", "run").await).await;
}
