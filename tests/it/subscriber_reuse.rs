//! The subscriber's output I/O follows what changed: files identical to the
//! previous version are hard links of it, a shard with one changed tensor is
//! cloned and patched (header + that tensor), and the result is still the
//! publisher's checkpoint, bit for bit.

use crate::common;

use std::collections::BTreeMap;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use weightcast::dtype::Dtype;
use weightcast::generator::{Generator, GeneratorConfig};
use weightcast::publisher::Publisher;
use weightcast::subscriber::{CaughtUp, catch_up};
use weightcast::tensors::{Digests, TensorSet};

const SHARD_A: &str = "model-00001-of-00002.safetensors";
const SHARD_B: &str = "model-00002-of-00002.safetensors";
const INDEX: &str = "model.safetensors.index.json";
const CONFIG: &str = "config.json";
/// The one tensor that trains; everything else is frozen.
const TRAINED: &str = "model.layers.0.mlp.down_proj.weight";

type Tensor = (String, Dtype, Vec<usize>, Vec<u8>);

fn tensors_of(set: &TensorSet) -> Vec<Tensor> {
    set.tensors()
        .iter()
        .enumerate()
        .map(|(i, t)| {
            (
                t.name.clone(),
                t.dtype,
                t.shape.clone(),
                set.data(i).to_vec(),
            )
        })
        .collect()
}

/// Shard B holds layer 1 (frozen), shard A the rest; in shard A only
/// `TRAINED` takes the current step's values (plus `extra`, when given).
fn write_checkpoint(dir: &Path, frozen: &TensorSet, now: &TensorSet, extra: Option<Tensor>) {
    std::fs::create_dir_all(dir).unwrap();
    let mut a = Vec::new();
    let mut b = Vec::new();
    let mut index = serde_json::Map::new();
    for (name, dtype, shape, data) in tensors_of(frozen) {
        let data = if name == TRAINED {
            now.data(now.position(&name).unwrap()).to_vec()
        } else {
            data
        };
        let (shard, file) = if name.contains("layers.1.") {
            (&mut b, SHARD_B)
        } else {
            (&mut a, SHARD_A)
        };
        index.insert(name.clone(), file.into());
        shard.push((name, dtype, shape, data));
    }
    if let Some(t) = extra {
        index.insert(t.0.clone(), SHARD_A.into());
        a.push(t);
    }
    for (file, items) in [(SHARD_A, a), (SHARD_B, b)] {
        let set = TensorSet::from_tensors(items).unwrap();
        let mut f = std::fs::File::create(dir.join(file)).unwrap();
        set.write_to(&BTreeMap::new(), &mut f).unwrap();
    }
    std::fs::write(
        dir.join(INDEX),
        serde_json::json!({"weight_map": index}).to_string(),
    )
    .unwrap();
    std::fs::write(dir.join(CONFIG), "{\"model_type\": \"llama\"}").unwrap();
}

/// `out/current` holds exactly the checkpoint's tensors and files.
fn assert_matches(out: &Path, ckpt: &Path) {
    let cur = out.join("current");
    for shard in [SHARD_A, SHARD_B] {
        let got = TensorSet::read(&cur.join(shard), Digests::Compute).unwrap();
        let want = TensorSet::read(&ckpt.join(shard), Digests::Compute).unwrap();
        assert_eq!(got.len(), want.len(), "{shard}");
        for (i, t) in want.tensors().iter().enumerate() {
            let j = got.position(&t.name).unwrap();
            assert!(got.data(j) == want.data(i), "{shard}: {} differs", t.name);
        }
    }
    for file in [INDEX, CONFIG] {
        assert_eq!(
            std::fs::read(cur.join(file)).unwrap(),
            std::fs::read(ckpt.join(file)).unwrap(),
            "{file}"
        );
    }
}

fn inodes(out: &Path) -> BTreeMap<&'static str, u64> {
    [SHARD_A, SHARD_B, INDEX, CONFIG]
        .into_iter()
        .map(|f| {
            (
                f,
                std::fs::metadata(out.join("current").join(f))
                    .unwrap()
                    .ino(),
            )
        })
        .collect()
}

fn dir_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().metadata().unwrap().len())
        .sum()
}

/// Offset of the tensor data in a safetensors file (8 + header length).
fn data_start(file: &Path) -> u64 {
    let bytes = std::fs::read(file).unwrap();
    8 + u64::from_le_bytes(bytes[..8].try_into().unwrap())
}

fn trained_bytes(set: &TensorSet) -> u64 {
    let i = set.position(TRAINED).unwrap();
    set.tensors()[i].range.len() as u64
}

#[tokio::test]
async fn unchanged_files_are_linked_and_changed_tensors_patched() {
    let (store, _bucket) = common::local_store();
    let work = tempfile::tempdir().unwrap();
    let cfg = common::publisher_config(&work.path().join("pub-state"), 5, None);
    let mut publisher = Publisher::open(store.clone(), cfg).await.unwrap();
    let mut g = Generator::new(GeneratorConfig::llama(3, 1024, 128, 256, 2));
    let frozen = g.snapshot();
    let out = work.path().join("sub");
    let ckpt = |v: u64| -> PathBuf { work.path().join(format!("ckpt-{v}")) };

    let mut log: Vec<CaughtUp> = Vec::new();
    let mut before = BTreeMap::new();
    for v in 0..=11u64 {
        if v > 0 {
            g.step();
        }
        let extra = (v == 11).then(|| {
            (
                "extra.weight".to_string(),
                Dtype::BF16,
                vec![8],
                vec![7u8; 16],
            )
        });
        write_checkpoint(&ckpt(v), &frozen, &g.snapshot(), extra);
        let published = publisher
            .publish_path(&ckpt(v), &Default::default())
            .await
            .unwrap();
        assert_eq!(published.version, v);

        let c = catch_up(&store, &out).await.unwrap().unwrap();
        assert_eq!(c.version, v);
        assert_matches(&out, &ckpt(v));
        let cur = out.join("current");
        let total = dir_bytes(&cur);
        assert_eq!(c.written_bytes + c.reused_bytes, total, "v{v}: {c:?}");
        assert_eq!(std::fs::read_dir(out.join("versions")).unwrap().count(), 1);
        let now = inodes(&out);
        if v == 0 {
            assert_eq!((c.written_bytes, c.reused_bytes), (total, 0));
        } else {
            // Anchors (v5, v10, v11) included: what did not change is
            // linked; the index changes at v11 (a new tensor).
            for f in [SHARD_B, INDEX, CONFIG] {
                if f == INDEX && v == 11 {
                    assert_ne!(now[f], before[f], "v{v}: changed {f} reused");
                } else {
                    assert_eq!(now[f], before[f], "v{v}: {f} is not a hard link");
                }
            }
            assert_ne!(
                now[SHARD_A], before[SHARD_A],
                "v{v}: shard A reused in place"
            );
            let a = TensorSet::read(&cur.join(SHARD_A), Digests::Skip).unwrap();
            let a_size = std::fs::metadata(cur.join(SHARD_A)).unwrap().len();
            if v < 11 {
                // Patched: its header and the trained tensor, nothing else.
                assert_eq!(
                    c.written_bytes,
                    data_start(&cur.join(SHARD_A)) + trained_bytes(&a),
                    "v{v}: {c:?}"
                );
                assert!(c.written_bytes * 10 < total, "v{v}: {c:?}");
                assert!(c.copied_bytes == 0 || c.copied_bytes == a_size, "{c:?}");
            } else {
                // A new tensor moved every offset: shard A is written in full,
                // and the index.
                let index = std::fs::metadata(cur.join(INDEX)).unwrap().len();
                assert_eq!(c.written_bytes, a_size + index, "v{v}: {c:?}");
                assert!(c.from_anchor);
            }
        }
        before = now;
        log.push(c);
    }
    // v5 and v10 are anchors, which a subscriber at the version before crosses
    // by their bridge deltas; v11 changed the structure (an anchor without
    // bridges), loaded whole, and still reused what had not changed.
    assert!(!log[5].from_anchor && log[11].from_anchor);
    let written: u64 = log[1..11].iter().map(|c| c.written_bytes).sum();
    let reused: u64 = log[1..11].iter().map(|c| c.reused_bytes).sum();
    eprintln!(
        "v1..v10: {written} bytes written, {reused} reused ({:.2}% written)",
        100.0 * written as f64 / (written + reused) as f64
    );
}

/// A materialized file damaged on disk is never reused: the next catch-up
/// re-bootstraps and writes everything afresh.
#[tokio::test]
async fn damaged_local_files_are_not_reused() {
    let (store, _bucket) = common::local_store();
    let work = tempfile::tempdir().unwrap();
    let cfg = common::publisher_config(&work.path().join("pub-state"), 100, None);
    let mut publisher = Publisher::open(store.clone(), cfg).await.unwrap();
    let mut g = Generator::new(GeneratorConfig::tiny(4));
    let frozen = g.snapshot();
    let out = work.path().join("sub");
    for v in 0..2u64 {
        if v > 0 {
            g.step();
        }
        let dir = work.path().join(format!("ckpt-{v}"));
        write_checkpoint(&dir, &frozen, &g.snapshot(), None);
        publisher
            .publish_path(&dir, &Default::default())
            .await
            .unwrap();
        catch_up(&store, &out).await.unwrap().unwrap();
    }
    // Damage the frozen shard (a hard link of every earlier version's) and the
    // config.
    for f in [SHARD_B, CONFIG] {
        let p = out.join("current").join(f);
        let mut bytes = std::fs::read(&p).unwrap();
        let last = bytes.len() - 2;
        bytes[last] ^= 1;
        std::fs::write(&p, bytes).unwrap();
    }
    g.step();
    let dir = work.path().join("ckpt-2");
    write_checkpoint(&dir, &frozen, &g.snapshot(), None);
    publisher
        .publish_path(&dir, &Default::default())
        .await
        .unwrap();
    let c = catch_up(&store, &out).await.unwrap().unwrap();
    assert!(c.from_anchor && c.version == 2, "{c:?}");
    assert_eq!(c.reused_bytes, 0, "{c:?}");
    assert_matches(&out, &dir);
}
