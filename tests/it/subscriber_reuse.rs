//! The output directory's slots: versions alternate between slots patched in
//! place (a version costs the changed elements, never a copy of the model),
//! every version is the publisher's checkpoint bit for bit, deleted files
//! disappear, damaged or dirty slots are rebuilt; and the same catch-up into
//! memory, the caller's own buffers included.

use crate::common;

use std::collections::BTreeMap;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use weightcast::generator::{Generator, GeneratorConfig};
use weightcast::publisher::Publisher;
use weightcast::store::Store;
use weightcast::subscriber::status::Shared;
use weightcast::subscriber::{
    CaughtUp, Daemon, DaemonConfig, Fetcher, MemorySink, Sink, Subscriber, VersionSource, catch_up,
    once,
};
use weightcast::tensors::{Digests, ExternalBuffer, TensorSet};

const SHARD_A: &str = "model-00001-of-00002.safetensors";
const SHARD_B: &str = "model-00002-of-00002.safetensors";
const INDEX: &str = "model.safetensors.index.json";
const CONFIG: &str = "config.json";
const VOCAB: &str = "tokenizer.json";

/// A training run publishing two-shard checkpoints: shard A the layers,
/// shard B the rest; the index, the config and a
/// tokenizer file (present while `vocab` is set).
struct Run {
    g: Generator,
    publisher: Publisher,
    work: PathBuf,
    published: Vec<PathBuf>,
    vocab: bool,
}

impl Run {
    async fn new(store: &Store, work: &Path, model: GeneratorConfig, every: u64) -> Run {
        let cfg = common::publisher_config(&work.join("pub-state"), every, None);
        Run {
            g: Generator::new(model),
            publisher: Publisher::open(store.clone(), cfg).await.unwrap(),
            work: work.to_path_buf(),
            published: Vec::new(),
            vocab: true,
        }
    }

    /// One training step (none before the first version), published.
    async fn step(&mut self) -> PathBuf {
        if !self.published.is_empty() {
            self.g.step();
        }
        let v = self.published.len() as u64;
        let dir = self.work.join(format!("ckpt-{v}"));
        std::fs::create_dir_all(&dir).unwrap();
        let set = self.g.snapshot_without_digests();
        let mut index = serde_json::Map::new();
        for (file, layers) in [(SHARD_A, true), (SHARD_B, false)] {
            let items: Vec<_> = set
                .tensors()
                .iter()
                .enumerate()
                .filter(|(_, t)| t.name.contains(".layers.") == layers)
                .map(|(i, t)| {
                    index.insert(t.name.clone(), file.into());
                    (
                        t.name.clone(),
                        t.dtype,
                        t.shape.clone(),
                        set.data(i).to_vec(),
                    )
                })
                .collect();
            let shard = TensorSet::from_tensors(items).unwrap();
            let mut f = std::io::BufWriter::new(std::fs::File::create(dir.join(file)).unwrap());
            shard.write_to(&BTreeMap::new(), &mut f).unwrap();
        }
        std::fs::write(
            dir.join(INDEX),
            serde_json::json!({ "weight_map": index }).to_string(),
        )
        .unwrap();
        std::fs::write(dir.join(CONFIG), format!("{{\"revision\": {}}}", v / 3)).unwrap();
        if self.vocab {
            std::fs::write(dir.join(VOCAB), "{\"a\": 1}").unwrap();
        }
        let p = self
            .publisher
            .publish_path(&dir, &Default::default())
            .await
            .unwrap();
        assert_eq!(p.version, v);
        self.published.push(dir.clone());
        dir
    }
}

/// Every file under `dir`, relative.
fn files(dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let mut todo = vec![PathBuf::new()];
    while let Some(rel) = todo.pop() {
        for e in std::fs::read_dir(dir.join(&rel)).unwrap() {
            let e = e.unwrap();
            let name = rel.join(e.file_name());
            if e.file_type().unwrap().is_dir() {
                todo.push(name);
            } else {
                out.push(name.to_string_lossy().into_owned());
            }
        }
    }
    out.sort();
    out
}

/// `dir` holds exactly the checkpoint `ckpt`: the same files, every tensor's
/// bytes, every other file's bytes; and each output file is a plain
/// safetensors file with `format=pt` and no weightcast keys.
fn assert_same(dir: &Path, ckpt: &Path) {
    assert_eq!(files(dir), files(ckpt), "{}", dir.display());
    for name in files(ckpt) {
        let (g, w) = (dir.join(&name), ckpt.join(&name));
        if name.ends_with(".safetensors") {
            let got = TensorSet::read(&g, Digests::Skip).unwrap();
            let want = TensorSet::read(&w, Digests::Skip).unwrap();
            assert_eq!(got.len(), want.len(), "{name}");
            for (i, t) in want.tensors().iter().enumerate() {
                let j = got.position(&t.name).unwrap();
                assert_eq!(got.tensors()[j].shape, t.shape, "{name}: {}", t.name);
                assert!(got.data(j) == want.data(i), "{name}: {} differs", t.name);
            }
            assert_eq!(got.metadata().get("format").map(String::as_str), Some("pt"));
            assert!(
                got.metadata().keys().all(|k| !k.starts_with("weightcast.")),
                "{name}: {:?}",
                got.metadata()
            );
        } else {
            assert_eq!(
                std::fs::read(&g).unwrap(),
                std::fs::read(&w).unwrap(),
                "{name}"
            );
        }
    }
}

fn current(out: &Path) -> String {
    std::fs::read_link(out.join("current"))
        .unwrap()
        .to_string_lossy()
        .into_owned()
}

fn inode(p: &Path) -> u64 {
    std::fs::metadata(p).unwrap().ino()
}

fn model_bytes(ckpt: &Path) -> u64 {
    [SHARD_A, SHARD_B]
        .iter()
        .map(|f| std::fs::metadata(ckpt.join(f)).unwrap().len())
        .sum()
}

/// A bucket, a training run publishing into it, and a subscriber's output
/// directory.
struct Fixture {
    store: Store,
    _bucket: tempfile::TempDir,
    work: tempfile::TempDir,
    run: Run,
    out: PathBuf,
}

impl Fixture {
    /// A fixture whose subscriber has caught up to each of the first
    /// `versions` versions in turn.
    async fn new(model: GeneratorConfig, every: u64, versions: u64) -> Fixture {
        let (store, _bucket) = common::local_store();
        let work = tempfile::tempdir().unwrap();
        let run = Run::new(&store, work.path(), model, every).await;
        let out = work.path().join("sub");
        let mut f = Fixture {
            store,
            _bucket,
            work,
            run,
            out,
        };
        for _ in 0..versions {
            f.next().await;
        }
        f
    }

    /// Publishes the next version and catches up to it; checks that
    /// `current` is exactly that checkpoint.
    async fn next(&mut self) -> CaughtUp {
        let ckpt = self.run.step().await;
        let c = catch_up(&self.store, &self.out).await.unwrap().unwrap();
        assert_eq!(c.version + 1, self.run.published.len() as u64, "{c:?}");
        assert_same(&self.out.join("current"), &ckpt);
        c
    }
}

/// (a) + (b): slots alternate, every version is the publisher's checkpoint,
/// and from the third version on a one-behind catch-up brings the old slot
/// forward from the journal and patches it in place: the bytes written are
/// the changed elements (far below the model), no file is copied or replaced.
#[tokio::test]
async fn slots_alternate_and_a_version_costs_what_changed() {
    // About 2.3 M bf16 elements (4.6 MB), every tensor training.
    let mut f = Fixture::new(GeneratorConfig::llama(3, 2048, 256, 512, 2), 100, 0).await;
    let out = f.out.clone();
    let mut log: Vec<CaughtUp> = Vec::new();
    let mut inodes: BTreeMap<String, u64> = BTreeMap::new();
    for v in 0..=6u64 {
        let c = f.next().await;
        let (run, ckpt) = (&f.run, &f.run.published[v as usize]);
        let slot = if v % 2 == 0 { "slots/a" } else { "slots/b" };
        assert_eq!(current(&out), slot, "{c:?}");
        assert_eq!(c.slot.as_deref(), Some(&slot[6..]));
        // The slot left behind still holds the previous version, untouched.
        if v > 0 {
            let other = if v % 2 == 0 { "slots/b" } else { "slots/a" };
            assert_same(&out.join(other), &run.published[v as usize - 1]);
        }
        let model = model_bytes(ckpt);
        let shard = out.join("current").join(SHARD_A);
        match v {
            0 => assert!(c.from_anchor && c.written_bytes >= model, "{c:?}"),
            // The empty second slot is built once, by a clone of the first.
            1 => assert!(!c.from_anchor && c.journal_bytes == 0, "{c:?}"),
            _ => {
                assert!(!c.from_anchor, "{c:?}");
                assert_eq!(c.cloned_bytes, 0, "{c:?}");
                assert!(
                    c.journal_bytes > 0,
                    "v{v}: brought forward from the journal: {c:?}"
                );
                assert!(
                    c.written_bytes * 10 < model,
                    "v{v}: {} bytes written for a {model}-byte model: {c:?}",
                    c.written_bytes
                );
                // Patched in place: the same file as two versions ago.
                assert_eq!(inodes[slot], inode(&shard), "v{v}: {SHARD_A} was replaced");
            }
        }
        inodes.insert(slot.to_string(), inode(&shard));
        log.push(c);
    }
    let model = model_bytes(&f.run.published[6]);
    let steady: u64 = log[2..].iter().map(|c| c.written_bytes).sum();
    eprintln!(
        "v2..v6: {steady} bytes written for a {model}-byte model ({:.2}% per version)",
        100.0 * steady as f64 / (5 * model) as f64
    );
}

/// The daemon brings the standby slot forward right after each switch (and
/// its hooks): the next version then costs one apply, nothing from the
/// journal, no copy — and both slots hold the current version in between.
#[tokio::test]
async fn the_daemon_keeps_the_standby_slot_current() {
    let f = Fixture::new(GeneratorConfig::llama(4, 2048, 256, 512, 2), 100, 0).await;
    let mut run = f.run;
    let mut d = Daemon::open(&f.store, &DaemonConfig::new(&f.out)).unwrap();
    d.prepare = true;
    let shared = Shared::new(f.store.url(), None);
    for v in 0..=4u64 {
        let ckpt = run.step().await;
        let (c, _) = d.iterate(&shared, true).await.unwrap().unwrap();
        assert_eq!(c.version, v, "{c:?}");
        assert_same(&f.out.join("current"), &ckpt);
        let standby = if current(&f.out) == "slots/a" {
            "b"
        } else {
            "a"
        };
        assert_same(&f.out.join("slots").join(standby), &ckpt);
        if v == 3 {
            // Written behind the daemon's back (its mapping of the file
            // sees it too): not trusted, rebuilt by a copy.
            assert!(c.cloned_bytes > 0, "{c:?}");
        } else if v > 0 {
            assert_eq!((c.journal_bytes, c.cloned_bytes), (0, 0), "{c:?}");
            assert!(c.written_bytes * 20 < model_bytes(&ckpt), "{c:?}");
        }
        if v == 2 {
            use std::os::unix::fs::FileExt;
            let p = f.out.join("slots").join(standby).join(SHARD_A);
            let file = std::fs::OpenOptions::new().write(true).open(p).unwrap();
            let at = file.metadata().unwrap().len() - 5;
            file.write_all_at(&[0x55], at).unwrap();
        }
    }
    let s = shared.status.lock().unwrap().clone();
    assert!(s.bytes_journal > 0 && s.store_requests > 0, "{s:?}");
}

/// (c): three slots rotate; a version's files stay untouched for two more versions.
#[tokio::test]
async fn three_slots_keep_two_versions_back_untouched() {
    let (store, _bucket) = common::local_store();
    let work = tempfile::tempdir().unwrap();
    let mut run = Run::new(&store, work.path(), GeneratorConfig::tiny(5), 100).await;
    let out = work.path().join("sub");
    let mut cfg = DaemonConfig::new(&out);
    cfg.slots = 3;
    let mut seen = Vec::new();
    for v in 0..=6u64 {
        let ckpt = run.step().await;
        let (c, _) = once(&store, &cfg).await.unwrap().unwrap();
        assert_eq!(c.version, v);
        seen.push(current(&out));
        assert_same(&out.join("current"), &ckpt);
        // The two versions before are still in their slots, byte for byte.
        for back in 1..=2u64.min(v) {
            let slot = &seen[(v - back) as usize];
            assert_same(&out.join(slot), &run.published[(v - back) as usize]);
        }
    }
    assert_eq!(
        seen,
        ["a", "b", "c", "a", "b", "c", "a"].map(|s| format!("slots/{s}"))
    );
    // Fewer slots later: the extra one goes (it is not current).
    cfg.slots = 2;
    run.step().await;
    once(&store, &cfg).await.unwrap().unwrap();
    assert!(!out.join("slots/c").exists());
    assert_same(&out.join("current"), &run.published[7]);
}

/// (d): a non-tensor file deleted from the checkpoint disappears from
/// `current`, in a replay and in a slot
/// brought forward from the journal.
#[tokio::test]
async fn a_deleted_file_disappears() {
    let mut f = Fixture::new(GeneratorConfig::tiny(6), 100, 3).await;
    assert!(f.out.join("current").join(VOCAB).exists());
    f.run.vocab = false;
    let c = f.next().await; // v3: no tokenizer
    assert!(!c.from_anchor, "{c:?}");
    assert!(!f.out.join("current").join(VOCAB).exists());
    // The other slot (at v2) catches up through the journal, deletion included.
    let c = f.next().await;
    assert!(c.journal_bytes > 0, "{c:?}");
}

/// (f): a slot left dirty by a crash, or changed behind the state's back,
/// is never trusted: it is rebuilt from the current slot, then patched.
#[tokio::test]
async fn dirty_or_changed_slots_are_rebuilt() {
    let mut f = Fixture::new(GeneratorConfig::tiny(7), 100, 3).await;
    let out = f.out.clone();
    // Now current = a (v2), b holds v1. As a crash mid-update would leave it:
    // b marked dirty, with a byte of it already changed.
    assert_eq!(current(&out), "slots/a");
    let state_path = out.join(".state.json");
    let mut state: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&state_path).unwrap()).unwrap();
    state["slots"]["b"]["dirty"] = true.into();
    std::fs::write(&state_path, state.to_string()).unwrap();
    let flip = |p: &Path| {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(p)
            .unwrap();
        let mut b = [0u8; 1];
        let at = f.metadata().unwrap().len() - 3;
        f.read_exact_at(&mut b, at).unwrap();
        f.write_all_at(&[b[0] ^ 0x20], at).unwrap();
    };
    flip(&out.join("slots/b").join(SHARD_B));
    let c = f.next().await; // v3
    assert_eq!((c.from_anchor, c.journal_bytes), (false, 0), "{c:?}");
    assert_eq!(current(&out), "slots/b");

    // Clean in the state, but a file was written behind its back (slot a, at
    // v2): its stamps no longer match, so it is rebuilt, not trusted.
    flip(&out.join("slots/a").join(SHARD_B));
    let c = f.next().await; // v4
    assert_eq!(c.journal_bytes, 0, "{c:?}");
    // Undamaged, the next one is brought forward from the journal again.
    let c = f.next().await; // v5
    assert!(c.journal_bytes > 0, "{c:?}");
}

/// A lost (or unreadable) state: nothing is trusted, and the slot `current`
/// points to is still never written — the repair goes into the other slot.
#[tokio::test]
async fn a_lost_state_never_writes_the_current_slot() {
    let f = Fixture::new(GeneratorConfig::tiny(11), 100, 3).await;
    assert_eq!(current(&f.out), "slots/a");
    let before: Vec<Vec<u8>> = files(&f.out.join("slots/a"))
        .iter()
        .map(|n| std::fs::read(f.out.join("slots/a").join(n)).unwrap())
        .collect();
    std::fs::write(f.out.join(".state.json"), "{not json").unwrap();
    let c = catch_up(&f.store, &f.out).await.unwrap().unwrap();
    assert_eq!((c.version, c.from_anchor, c.repairs), (2, true, 1), "{c:?}");
    assert_eq!(current(&f.out), "slots/b");
    assert_same(&f.out.join("current"), &f.run.published[2]);
    let after: Vec<Vec<u8>> = files(&f.out.join("slots/a"))
        .iter()
        .map(|n| std::fs::read(f.out.join("slots/a").join(n)).unwrap())
        .collect();
    assert!(before == after, "the slot current pointed to was written");
}

/// A crash after a slot was recorded clean but before `current` switched
/// to it: the next start verifies that slot, finishes the switch, and runs
/// the hooks the engine is owed.
#[tokio::test]
async fn an_interrupted_switch_is_finished() {
    let f = Fixture::new(GeneratorConfig::tiny(10), 100, 3).await;
    let (store, out, run) = (&f.store, &f.out, &f.run);
    assert_eq!(current(out), "slots/a");
    // As the crash left it: the state records a at v2, current still on b (v1).
    std::fs::remove_file(out.join("current")).unwrap();
    std::os::unix::fs::symlink("slots/b", out.join("current")).unwrap();
    let marker = f.work.path().join("hook-ran");
    let mut cfg = DaemonConfig::new(out);
    cfg.hooks = vec![
        format!("command:echo $WEIGHTCAST_VERSION > {}", marker.display())
            .parse()
            .unwrap(),
    ];
    let (c, report) = once(store, &cfg).await.unwrap().unwrap();
    assert_eq!((c.version, c.downloaded, report.failed), (2, 0, 0), "{c:?}");
    assert_eq!(current(out), "slots/a");
    assert_eq!(std::fs::read_to_string(&marker).unwrap().trim(), "2");
    assert_same(&out.join("current"), &run.published[2]);
}

/// The output directory of older releases (`versions/<version>` behind
/// `current`) is taken over: the first catch-up bootstraps into a slot and
/// removes the old directories.
#[tokio::test]
async fn the_old_layout_is_taken_over() {
    let (store, _bucket) = common::local_store();
    let work = tempfile::tempdir().unwrap();
    let mut run = Run::new(&store, work.path(), GeneratorConfig::tiny(8), 100).await;
    let out = work.path().join("sub");
    let ckpt = run.step().await;
    let old = out.join("versions").join(format!("{:020}", 0));
    std::fs::create_dir_all(&old).unwrap();
    std::fs::write(old.join(CONFIG), "{}").unwrap();
    std::os::unix::fs::symlink(
        Path::new("versions").join(format!("{:020}", 0)),
        out.join("current"),
    )
    .unwrap();
    std::fs::write(out.join(".state.json"), "{\"version\": 0, \"digests\": {}}").unwrap();
    let c = catch_up(&store, &out).await.unwrap().unwrap();
    assert!(c.from_anchor, "{c:?}");
    assert_eq!(current(&out), "slots/a");
    assert!(!out.join("versions").exists());
    assert_same(&out.join("current"), &ckpt);
}

/// A second subscriber on the same directory is refused.
#[tokio::test]
async fn one_subscriber_per_directory() {
    let work = tempfile::tempdir().unwrap();
    let out = work.path().join("sub");
    let _held = weightcast::subscriber::DirSink::open(&out, 2).unwrap();
    let err = weightcast::subscriber::DirSink::open(&out, 2)
        .unwrap_err()
        .to_string();
    assert!(err.contains("another subscriber"), "{err}");
    let err = weightcast::subscriber::DirSink::open(&work.path().join("x"), 1)
        .unwrap_err()
        .to_string();
    assert!(err.contains("--slots"), "{err}");
}

/// Caller-owned memory: an engine's tensors, lent to the set.
struct Lent(Vec<u8>);

impl ExternalBuffer for Lent {
    fn bytes(&self) -> &[u8] {
        &self.0
    }
    fn bytes_mut(&mut self) -> Option<&mut [u8]> {
        Some(&mut self.0)
    }
}

/// The same parts composed with a memory sink: bit-identical at every
/// version, and a sink over the caller's buffers is patched in place.
#[tokio::test]
async fn the_same_catch_up_into_memory() {
    let (store, _bucket) = common::local_store();
    let work = tempfile::tempdir().unwrap();
    let mut run = Run::new(&store, work.path(), GeneratorConfig::tiny(9), 3).await;
    let source = || VersionSource::new(std::time::Duration::from_secs(1), 0.0);
    let mut sub = Subscriber::new(Fetcher::new(store.clone()), source(), MemorySink::new());
    for v in 0..=4u64 {
        let ckpt = run.step().await;
        let c = sub.catch_up(true).await.unwrap().unwrap();
        assert_eq!(c.version, v);
        for (name, set) in sub.sink.tensors() {
            let want = TensorSet::read(&ckpt.join(name), Digests::Compute).unwrap();
            assert_eq!(set.len(), want.len());
            for (i, t) in want.tensors().iter().enumerate() {
                assert!(set.data(set.position(&t.name).unwrap()) == want.data(i));
            }
            assert_eq!(set.digest(), want.digest());
        }
        assert_eq!(
            sub.sink.files()[CONFIG],
            std::fs::read(ckpt.join(CONFIG)).unwrap()
        );
    }

    // Caller-owned buffers (zeroed, the model's structure), nothing held: the
    // first catch-up copies the anchor into them, the next ones patch them.
    let mut tensors = BTreeMap::new();
    for (name, set) in sub.sink.tensors() {
        let items = set.tensors().iter().map(|t| {
            let b: Box<dyn ExternalBuffer> = Box::new(Lent(vec![0u8; t.range.len()]));
            (t.name.clone(), t.dtype, t.shape.clone(), b)
        });
        tensors.insert(name.clone(), TensorSet::from_external(items).unwrap());
    }
    let sink = MemorySink::with_state(None, tensors, BTreeMap::new()).unwrap();
    let mut lent = Subscriber::new(Fetcher::new(store.clone()), source(), sink);
    for v in 5..=7u64 {
        let ckpt = run.step().await;
        let c = lent.catch_up(true).await.unwrap().unwrap();
        assert_eq!((c.version, c.from_anchor), (v, v == 5), "{c:?}");
        assert_eq!(lent.sink.held(), Some(v));
        for (name, set) in lent.sink.tensors() {
            assert!(
                set.is_shared(),
                "{name}: the caller's buffers were replaced"
            );
            let want = TensorSet::read(&ckpt.join(name), Digests::Compute).unwrap();
            assert_eq!(set.digest(), want.digest());
            for (i, t) in want.tensors().iter().enumerate() {
                assert!(set.data(set.position(&t.name).unwrap()) == want.data(i));
            }
        }
        assert_eq!(
            lent.sink.files()[VOCAB],
            std::fs::read(ckpt.join(VOCAB)).unwrap()
        );
    }
}
