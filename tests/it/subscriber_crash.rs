//! Crash safety of the subscriber: the real binary (`weightcast subscribe
//! --once`) is killed with SIGKILL at instants spread over a whole run, again
//! and again, while new versions keep arriving. After every kill:
//!
//! - `DIR/current`, if present, points to a directory holding exactly the
//!   publisher's checkpoint of that version (every tensor's bytes, every file);
//! - `DIR/.state.json`, if present, names a version and directory that verify
//!   the same way.
//!
//! A last uninterrupted run must converge to the newest version bit-identically.

use crate::common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use weightcast::generator::{Generator, GeneratorConfig};
use weightcast::publisher::Publisher;
use weightcast::store::Store;
use weightcast::tensors::{Digests, TensorSet};

const SHARD_A: &str = "model-00001-of-00002.safetensors";
const SHARD_B: &str = "model-00002-of-00002.safetensors";

/// Shard A holds what trains (the layers), shard B what is frozen (embeddings,
/// LM head, final norm: a hard link from version to version).
fn write_checkpoint(dir: &Path, frozen: &TensorSet, trained: &TensorSet, config_rev: u64) {
    std::fs::create_dir_all(dir).unwrap();
    let mut index = serde_json::Map::new();
    for (file, set) in [(SHARD_A, trained), (SHARD_B, frozen)] {
        for t in set.tensors() {
            index.insert(t.name.clone(), file.into());
        }
        let mut f = std::io::BufWriter::new(std::fs::File::create(dir.join(file)).unwrap());
        set.write_to(&BTreeMap::new(), &mut f).unwrap();
    }
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        serde_json::json!({ "weight_map": index }).to_string(),
    )
    .unwrap();
    std::fs::write(
        dir.join("config.json"),
        format!("{{\"revision\": {config_rev}}}"),
    )
    .unwrap();
}

/// The publisher side: a training run publishing checkpoints into the bucket.
struct Trainer {
    g: Generator,
    frozen: TensorSet,
    publisher: Publisher,
    work: PathBuf,
    /// Published version → its checkpoint directory.
    published: BTreeMap<u64, PathBuf>,
}

impl Trainer {
    async fn publish(&mut self) -> u64 {
        if !self.published.is_empty() {
            self.g.step();
        }
        let n = self.published.len() as u64;
        let dir = self.work.join(format!("ckpt-{n}"));
        write_checkpoint(
            &dir,
            &self.frozen,
            &self.g.snapshot_without_digests(),
            n / 4,
        );
        let p = self
            .publisher
            .publish_path(&dir, &Default::default())
            .await
            .unwrap();
        self.published.insert(p.version, dir);
        p.version
    }

    fn newest(&self) -> u64 {
        *self.published.keys().last().unwrap()
    }
}

/// Checks that `dir` holds exactly the checkpoint `ckpt`: the same files, each
/// safetensors file with the same tensors byte for byte, every other file
/// identical. Returns a description of the first difference.
fn differs(dir: &Path, ckpt: &Path) -> Option<String> {
    let names = |d: &Path| -> Result<Vec<String>, String> {
        let mut v = std::fs::read_dir(d)
            .map_err(|e| format!("listing {}: {e}", d.display()))?
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect::<Vec<_>>();
        v.sort();
        Ok(v)
    };
    let (got, want) = match (names(dir), names(ckpt)) {
        (Ok(g), Ok(w)) => (g, w),
        (Err(e), _) | (_, Err(e)) => return Some(e),
    };
    if got != want {
        return Some(format!("files {got:?}, expected {want:?}"));
    }
    for name in &want {
        let (g, w) = (dir.join(name), ckpt.join(name));
        if name.ends_with(".safetensors") {
            let g = match TensorSet::read(&g, Digests::Skip) {
                Ok(s) => s,
                Err(e) => return Some(format!("{name}: {e}")),
            };
            let w = TensorSet::read(&w, Digests::Skip).unwrap();
            if g.len() != w.len() {
                return Some(format!("{name}: {} tensors, expected {}", g.len(), w.len()));
            }
            for (i, t) in w.tensors().iter().enumerate() {
                let same = g.position(&t.name).is_some_and(|j| {
                    let u = &g.tensors()[j];
                    u.dtype == t.dtype && u.shape == t.shape && g.data(j) == w.data(i)
                });
                if !same {
                    return Some(format!("{name}: tensor {} differs", t.name));
                }
            }
        } else if std::fs::read(&g).ok() != std::fs::read(&w).ok() {
            return Some(format!("{name} differs"));
        }
    }
    None
}

/// The version a directory under `versions/` holds (its first 20 digits).
fn version_of(dir_name: &str) -> Option<u64> {
    dir_name.get(..20)?.parse().ok()
}

/// What a kill left behind, checked against the invariants. Returns the
/// versions `current` and the state name (when present).
fn check_invariants(out: &Path, t: &Trainer, when: &str) -> (Option<u64>, Option<u64>) {
    let verify = |dir_name: &str, what: &str| -> u64 {
        let v = version_of(dir_name)
            .unwrap_or_else(|| panic!("{when}: {what} names an odd directory `{dir_name}`"));
        let ckpt = t
            .published
            .get(&v)
            .unwrap_or_else(|| panic!("{when}: {what} names unpublished version {v}"));
        let dir = out.join("versions").join(dir_name);
        if let Some(d) = differs(&dir, ckpt) {
            panic!("{when}: {what} -> {}: {d}", dir.display());
        }
        v
    };
    let link = out.join("current");
    let current = std::fs::symlink_metadata(&link).ok().map(|_| {
        let target = std::fs::read_link(&link).unwrap();
        let mut parts = target.components();
        assert_eq!(
            parts.next().map(|c| c.as_os_str().to_owned()),
            Some("versions".into()),
            "{when}: current -> {}",
            target.display()
        );
        let name = parts
            .next()
            .unwrap()
            .as_os_str()
            .to_str()
            .unwrap()
            .to_string();
        assert!(
            parts.next().is_none(),
            "{when}: current -> {}",
            target.display()
        );
        verify(&name, "current")
    });
    let state = std::fs::read(out.join(".state.json")).ok().map(|bytes| {
        let s: serde_json::Value = serde_json::from_slice(&bytes)
            .unwrap_or_else(|e| panic!("{when}: .state.json is not whole JSON: {e}"));
        let v = s["version"].as_u64().expect("state version");
        let dir = s["dir"]
            .as_str()
            .map(str::to_string)
            .unwrap_or_else(|| format!("{v:020}"));
        assert_eq!(version_of(&dir), Some(v), "{when}: state {s}");
        verify(&dir, "state")
    });
    (current, state)
}

fn subscribe(url: &str, out: &Path) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_weightcast"));
    c.args(["subscribe", "--store", url, "--once", "--out"])
        .arg(out)
        .env_remove("WEIGHTCAST_STORE")
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    c
}

/// Waits until the run has started materializing (a `versions/*.partial`
/// directory exists); false if it exited first.
fn wait_for_materialize(child: &mut Child, out: &Path) -> bool {
    let versions = out.join("versions");
    loop {
        let partial = std::fs::read_dir(&versions).is_ok_and(|mut d| {
            d.any(|e| e.is_ok_and(|e| e.file_name().to_string_lossy().ends_with(".partial")))
        });
        if partial {
            return true;
        }
        if child.try_wait().unwrap().is_some() {
            return false;
        }
        std::thread::sleep(Duration::from_micros(300));
    }
}

/// Sleeps for `d` unless the child exits first; then returns when it did.
fn sleep_unless_exit(child: &mut Child, d: Duration) -> Option<Duration> {
    let started = Instant::now();
    while started.elapsed() < d {
        if child.try_wait().unwrap().is_some() {
            return Some(started.elapsed());
        }
        std::thread::sleep(Duration::from_micros(500).min(d));
    }
    None
}

#[test]
fn kill_9_at_any_instant_then_restart_continues_from_a_verified_version() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let (store, bucket): (Store, _) = common::local_store();
    let url = url::Url::from_directory_path(bucket.path())
        .unwrap()
        .to_string();
    let work = tempfile::tempdir().unwrap();
    // About 12 M bf16 elements (25 MB) in two shards: 8 M frozen, 4.5 M trained.
    let model = GeneratorConfig::llama(11, 12288, 320, 896, 4);
    let part = |frozen: bool| {
        let mut c = model.clone();
        c.tensors.retain(|t| t.name.contains(".layers.") != frozen);
        c
    };
    let frozen = Generator::new(part(true)).snapshot_without_digests();
    let g = Generator::new(part(false));
    let cfg = common::publisher_config(&work.path().join("pub-state"), 4, None);
    let publisher = rt.block_on(Publisher::open(store.clone(), cfg)).unwrap();
    let mut t = Trainer {
        g,
        frozen,
        publisher,
        work: work.path().to_path_buf(),
        published: BTreeMap::new(),
    };
    for _ in 0..3 {
        rt.block_on(t.publish());
    }

    // How long an uninterrupted run takes (a bootstrap: the longest kind), and
    // how long the materialization of an incremental one does (from its
    // `.partial` directory to the exit).
    let probe = work.path().join("probe");
    let started = Instant::now();
    let status = subscribe(&url, &probe).status().unwrap();
    let mut full = started.elapsed();
    assert!(status.success());
    assert_eq!(check_invariants(&probe, &t, "probe"), (Some(2), Some(2)));
    rt.block_on(t.publish());
    let mut child = subscribe(&url, &probe).spawn().unwrap();
    assert!(wait_for_materialize(&mut child, &probe));
    let started = Instant::now();
    assert!(child.wait().unwrap().success());
    let mut materialize = started.elapsed();
    assert_eq!(check_invariants(&probe, &t, "probe"), (Some(3), Some(3)));

    let out = work.path().join("sub");
    let kills = 16u32;
    let (mut interrupted, mut in_materialize, mut mixed) = (0u32, 0u32, 0u32);
    for i in 0..kills {
        // A new version before every other round, so runs are killed while
        // replaying deltas, crossing anchors, and materializing.
        if i % 2 == 1 {
            rt.block_on(t.publish());
        }
        // Even rounds: anywhere in [0, full]; odd rounds: anywhere in the
        // materialization. Delays spread evenly (a golden-ratio sequence).
        let frac = (f64::from(i / 2) * 0.618_033_988_75 + 0.1).fract();
        let mut child = subscribe(&url, &out).spawn().unwrap();
        let (delay, exited) = if i % 2 == 0 {
            let delay = full.mul_f64(frac);
            (delay, sleep_unless_exit(&mut child, delay))
        } else if wait_for_materialize(&mut child, &out) {
            let delay = materialize.mul_f64(frac);
            (delay, sleep_unless_exit(&mut child, delay))
        } else {
            // Exited without materializing (nothing new): nothing learned.
            (Duration::ZERO, Some(materialize))
        };
        match exited {
            None => {
                interrupted += 1;
                in_materialize += i % 2;
            }
            // Runs got faster than measured (the machine is less busy, or
            // there was less to do): aim closer to what was just seen.
            Some(took) if i % 2 == 0 => full = took.max(full / 2),
            Some(took) => materialize = took.max(materialize / 2),
        }
        child.kill().unwrap(); // SIGKILL (no-op if it already exited)
        child.wait().unwrap();
        let phase = if i % 2 == 0 { "start" } else { "materializing" };
        let when = format!("kill {i}, {delay:?} after {phase} (newest v{})", t.newest());
        let (current, state) = check_invariants(&out, &t, &when);
        if current != state {
            mixed += 1;
        }
        // Now and then a run completes (the first rounds were killed
        // bootstraps; the next ones are killed incremental updates), and it
        // reaches the newest version from whatever the kills left.
        if i % 4 == 1 {
            assert!(subscribe(&url, &out).status().unwrap().success());
            let newest = Some(t.newest());
            let when = format!("run after kill {i}");
            assert_eq!(check_invariants(&out, &t, &when), (newest, newest));
        }
    }

    // Uninterrupted: converges to the newest version.
    rt.block_on(t.publish());
    let status = subscribe(&url, &out).status().unwrap();
    assert!(status.success());
    let newest = t.newest();
    assert_eq!(
        check_invariants(&out, &t, "final"),
        (Some(newest), Some(newest))
    );
    let left: Vec<_> = std::fs::read_dir(out.join("versions"))
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(left.len(), 1, "leftovers in versions/: {left:?}");
    eprintln!(
        "uninterrupted bootstrap {full:?}, incremental materialization {materialize:?}; \
         {kills} kills, {interrupted} while running ({in_materialize} while materializing), \
         {mixed} left current and state on different versions; converged to v{newest}"
    );
    // The kills must have landed inside runs, or this test proves nothing.
    assert!(
        interrupted >= kills / 2 && in_materialize >= kills / 4,
        "only {interrupted} kills interrupted a run, {in_materialize} a materialization"
    );
}
