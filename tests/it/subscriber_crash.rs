//! Crash safety of the subscriber: the real binary (`weightcast subscribe
//! --once`) is killed with SIGKILL at instants spread over a whole run, and
//! over its slot updates (marking a slot dirty, bringing it forward from the
//! journal or cloning it, applying, flushing, recording, switching), again
//! and again, while new versions keep arriving. After every kill:
//!
//! - `DIR/.state.json`, if present, is whole, and every slot it records clean
//!   holds exactly the publisher's checkpoint of its version (every tensor's
//!   bytes, every file);
//! - `DIR/current`, if present, points to a slot the state records clean.
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

/// What a kill left behind, checked against the invariants. Returns the
/// version `current` shows (when present) and whether an update was left
/// unfinished (a slot recorded dirty, or recorded clean at a newer version
/// than the current one: a switch the kill interrupted).
fn check_invariants(out: &Path, t: &Trainer, when: &str) -> (Option<u64>, bool) {
    let state: Option<serde_json::Value> = std::fs::read(out.join(".state.json")).ok().map(|b| {
        serde_json::from_slice(&b)
            .unwrap_or_else(|e| panic!("{when}: .state.json is not whole JSON: {e}"))
    });
    let mut clean = BTreeMap::new();
    let mut dirty = false;
    if let Some(slots) = state.as_ref().and_then(|s| s["slots"].as_object()) {
        for (name, s) in slots {
            if s["dirty"].as_bool().expect("dirty flag") {
                dirty = true;
                continue;
            }
            let Some(v) = s["version"].as_u64() else {
                continue;
            };
            let ckpt = t
                .published
                .get(&v)
                .unwrap_or_else(|| panic!("{when}: slot {name} records unpublished version {v}"));
            let dir = out.join("slots").join(name);
            if let Some(d) = differs(&dir, ckpt) {
                panic!("{when}: slot {name} (recorded clean at v{v}): {d}");
            }
            clean.insert(name.clone(), v);
        }
    }
    let link = out.join("current");
    let current = std::fs::symlink_metadata(&link).ok().map(|_| {
        let target = std::fs::read_link(&link).unwrap();
        let name = target
            .strip_prefix("slots")
            .unwrap_or_else(|_| panic!("{when}: current -> {}", target.display()))
            .to_string_lossy()
            .into_owned();
        *clean.get(&name).unwrap_or_else(|| {
            panic!("{when}: current -> {name}, which the state does not record clean: {state:?}")
        })
    });
    let ahead = clean.values().any(|&v| current.is_some_and(|c| v > c));
    (current, dirty || ahead)
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

/// Waits until the run has started updating a slot (the state records one
/// dirty); false if it exited first.
fn wait_for_update(child: &mut Child, out: &Path) -> bool {
    loop {
        let dirty = std::fs::read(out.join(".state.json"))
            .ok()
            .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
            .and_then(|s| {
                let slots = s["slots"].as_object()?.clone();
                Some(slots.values().any(|v| v["dirty"].as_bool() == Some(true)))
            })
            .unwrap_or(false);
        if dirty {
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
    // how long the slot update of an incremental one does (from the moment
    // it marks a slot dirty to the exit).
    let probe = work.path().join("probe");
    let started = Instant::now();
    let status = subscribe(&url, &probe).status().unwrap();
    let mut full = started.elapsed();
    assert!(status.success());
    assert_eq!(check_invariants(&probe, &t, "probe"), (Some(2), false));
    rt.block_on(t.publish());
    let mut child = subscribe(&url, &probe).spawn().unwrap();
    assert!(wait_for_update(&mut child, &probe));
    let started = Instant::now();
    assert!(child.wait().unwrap().success());
    let mut update = started.elapsed();
    assert_eq!(check_invariants(&probe, &t, "probe"), (Some(3), false));

    let out = work.path().join("sub");
    let kills = 16u32;
    let (mut interrupted, mut in_update, mut mixed) = (0u32, 0u32, 0u32);
    for i in 0..kills {
        // A new version before every other round, so runs are killed while
        // replaying deltas, crossing anchors, and updating slots.
        if i % 2 == 1 {
            rt.block_on(t.publish());
        }
        // Even rounds: anywhere in [0, full]; odd rounds: anywhere in the
        // slot update. Delays spread evenly (a golden-ratio sequence).
        let frac = (f64::from(i / 2) * 0.618_033_988_75 + 0.1).fract();
        let mut child = subscribe(&url, &out).spawn().unwrap();
        let (delay, exited) = if i % 2 == 0 {
            let delay = full.mul_f64(frac);
            (delay, sleep_unless_exit(&mut child, delay))
        } else if wait_for_update(&mut child, &out) {
            let delay = update.mul_f64(frac);
            (delay, sleep_unless_exit(&mut child, delay))
        } else {
            // Exited without updating (nothing new): nothing learned.
            (Duration::ZERO, Some(update))
        };
        match exited {
            None => {
                interrupted += 1;
                in_update += i % 2;
            }
            // Runs got faster than measured (the machine is less busy, or
            // there was less to do): aim closer to what was just seen.
            Some(took) if i % 2 == 0 => full = took.max(full / 2),
            Some(took) => update = took.max(update / 2),
        }
        child.kill().unwrap(); // SIGKILL (no-op if it already exited)
        child.wait().unwrap();
        let phase = if i % 2 == 0 {
            "start"
        } else {
            "updating a slot"
        };
        let when = format!("kill {i}, {delay:?} after {phase} (newest v{})", t.newest());
        let (_, unfinished) = check_invariants(&out, &t, &when);
        if unfinished {
            mixed += 1;
        }
        // Now and then a run completes (the first rounds were killed
        // bootstraps; the next ones are killed incremental updates), and it
        // reaches the newest version from whatever the kills left.
        if i % 4 == 1 {
            assert!(subscribe(&url, &out).status().unwrap().success());
            let newest = Some(t.newest());
            let when = format!("run after kill {i}");
            assert_eq!(check_invariants(&out, &t, &when), (newest, false));
        }
    }

    // Uninterrupted: converges to the newest version.
    rt.block_on(t.publish());
    let status = subscribe(&url, &out).status().unwrap();
    assert!(status.success());
    let newest = t.newest();
    assert_eq!(check_invariants(&out, &t, "final"), (Some(newest), false));
    let mut left: Vec<_> = std::fs::read_dir(out.join("slots"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    left.sort();
    assert_eq!(left, ["a", "b"], "leftovers in slots/");
    assert!(!out.join(".tmp").exists(), "a download was left behind");
    eprintln!(
        "uninterrupted bootstrap {full:?}, incremental update {update:?}; \
         {kills} kills, {interrupted} while running ({in_update} while updating a slot), \
         {mixed} left an update unfinished; converged to v{newest}"
    );
    // The kills must have landed inside runs, or this test proves nothing.
    assert!(
        interrupted >= kills / 2 && in_update >= kills / 4,
        "only {interrupted} kills interrupted a run, {in_update} a slot update"
    );
}

/// The subscriber killed (abort, as `kill -9`) at every named phase of a slot
/// update — deterministically, by failpoint — on a bootstrap and on an
/// incremental update: what is left satisfies the invariants, and the next
/// run reaches the newest version exactly.
#[test]
#[cfg_attr(
    not(feature = "failpoints"),
    ignore = "needs --features failpoints (scripts/test.sh enables it)"
)]
fn killed_at_every_named_phase_then_restart_converges() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let (store, bucket): (Store, _) = common::local_store();
    let url = url::Url::from_directory_path(bucket.path())
        .unwrap()
        .to_string();
    let work = tempfile::tempdir().unwrap();
    let model = GeneratorConfig::llama(13, 2048, 128, 256, 2);
    let part = |frozen: bool| {
        let mut c = model.clone();
        c.tensors.retain(|t| t.name.contains(".layers.") != frozen);
        c
    };
    let cfg = common::publisher_config(&work.path().join("pub-state"), 1000, None);
    let mut t = Trainer {
        g: Generator::new(part(false)),
        frozen: Generator::new(part(true)).snapshot_without_digests(),
        publisher: rt.block_on(Publisher::open(store.clone(), cfg)).unwrap(),
        work: work.path().to_path_buf(),
        published: BTreeMap::new(),
    };
    rt.block_on(t.publish());
    let bootstrap = [
        "subscriber.after_begin",
        "subscriber.after_anchor",
        "subscriber.before_switch",
        "subscriber.after_switch",
    ];
    let incremental = [
        "subscriber.after_begin",
        "subscriber.mid_apply",
        "subscriber.before_switch",
        "subscriber.after_switch",
    ];
    let crash = |out: &Path, point: &str| {
        let status = subscribe(&url, out)
            .env("WEIGHTCAST_FAILPOINT", point)
            .status()
            .unwrap();
        assert!(!status.success(), "{point} was not reached");
    };
    for point in bootstrap {
        let out = work.path().join(format!("fresh-{point}"));
        crash(&out, point);
        let when = format!("bootstrap killed at {point}");
        check_invariants(&out, &t, &when);
        assert!(subscribe(&url, &out).status().unwrap().success(), "{when}");
        assert_eq!(check_invariants(&out, &t, &when), (Some(t.newest()), false));
    }
    let out = work.path().join("following");
    assert!(subscribe(&url, &out).status().unwrap().success());
    for point in incremental {
        let before = t.newest();
        let v = rt.block_on(t.publish());
        let when = format!("update to v{v} killed at {point}");
        crash(&out, point);
        let (current, _) = check_invariants(&out, &t, &when);
        assert!(
            current == Some(before) || current == Some(v),
            "{when}: current {current:?}"
        );
        assert!(subscribe(&url, &out).status().unwrap().success(), "{when}");
        assert_eq!(check_invariants(&out, &t, &when), (Some(v), false));
    }
}
