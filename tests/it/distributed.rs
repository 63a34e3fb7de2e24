//! Distributed publish (issue 14, part 3): W trainer ranks, each with its own
//! state directory and its own shard files, commit exactly one version per
//! step holding every shard; a rank killed mid-upload leaves nothing
//! visible, and its restart completes the version.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

use weightcast::generator::{Generator, GeneratorConfig};
use weightcast::protocol::{VersionKind, read_manifest, versions_after};
use weightcast::publisher::{Checkpoint, Distributed, PublishOptions, Publisher};
use weightcast::store::Store;
use weightcast::tensors::{Digests, TensorSet};

use crate::common;

/// Rank `rank`'s shard of `set`: every `world`-th tensor.
fn shard(set: &TensorSet, rank: u32, world: u32) -> TensorSet {
    let items = set
        .tensors()
        .iter()
        .enumerate()
        .filter(|(i, _)| *i as u32 % world == rank)
        .map(|(i, t)| {
            (
                t.name.clone(),
                t.dtype,
                t.shape.clone(),
                set.data(i).to_vec(),
            )
        });
    TensorSet::from_tensors(items).unwrap()
}

fn shard_name(rank: u32, world: u32) -> String {
    format!("model-{:05}-of-{world:05}.safetensors", rank + 1)
}

fn config(step: u64) -> String {
    format!("{{\"step\": {step}}}")
}

/// Writes every rank's checkpoint directory of `step`: its shard and the
/// (identical) config.json.
fn write_step(work: &Path, g: &Generator, step: u64, world: u32) -> Vec<PathBuf> {
    let set = g.snapshot();
    (0..world)
        .map(|r| {
            let dir = work.join(format!("ckpt-{step}/rank-{r}"));
            std::fs::create_dir_all(&dir).unwrap();
            let mut f = std::fs::File::create(dir.join(shard_name(r, world))).unwrap();
            shard(&set, r, world)
                .write_to(&BTreeMap::new(), &mut f)
                .unwrap();
            std::fs::write(dir.join("config.json"), config(step)).unwrap();
            dir
        })
        .collect()
}

struct Rank<'a> {
    url: &'a str,
    env: &'a [(String, String)],
    state: PathBuf,
    rank: u32,
    world: u32,
    /// `--state-mode`, if not the default.
    mode: Option<&'a str>,
}

impl Rank<'_> {
    fn command(&self, ckpt: &Path, step: u64, failpoint: Option<&str>) -> Command {
        let mut c = common::publish_command(self.url, &self.state, ckpt, failpoint);
        c.args([
            "--rank".to_string(),
            self.rank.to_string(),
            "--world".to_string(),
            self.world.to_string(),
            "--step".to_string(),
            step.to_string(),
            "--rank-timeout".to_string(),
            "120".to_string(),
        ])
        .args(self.mode.map(|m| ["--state-mode", m]).into_iter().flatten())
        .envs(self.env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
        c
    }

    fn spawn(&self, ckpt: &Path, step: u64) -> Child {
        self.command(ckpt, step, None).spawn().unwrap()
    }
}

/// The one JSON line of a successful publish.
fn published(out: Output, what: &str) -> serde_json::Value {
    assert!(
        out.status.success(),
        "{what} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{what}: {e}"))
}

/// Catches `sub` up to `version` and checks it holds exactly every rank's
/// shard of `set` and the config of `step`, and nothing else.
async fn assert_subscriber_exact(
    store: &Store,
    sub: &Path,
    set: &TensorSet,
    (version, step): (u64, u64),
    world: u32,
) {
    let c = weightcast::subscriber::catch_up(store, sub)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(c.version, version, "the subscriber's version");
    let cur = sub.join("current");
    let mut seen = 0;
    for r in 0..world {
        let got = TensorSet::read(&cur.join(shard_name(r, world)), Digests::Compute).unwrap();
        let want = shard(set, r, world);
        assert_eq!(got.len(), want.len(), "step {step} rank {r}: tensor count");
        for (i, t) in want.tensors().iter().enumerate() {
            let j = got
                .position(&t.name)
                .unwrap_or_else(|| panic!("step {step}: tensor {} missing", t.name));
            assert!(
                got.data(j) == want.data(i),
                "step {step}: tensor {} differs",
                t.name
            );
            seen += 1;
        }
    }
    assert_eq!(seen, set.len(), "every tensor of the step");
    assert_eq!(
        std::fs::read_to_string(cur.join("config.json")).unwrap(),
        config(step)
    );
    let mut names: Vec<String> = std::fs::read_dir(&cur)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    let mut want: Vec<String> = (0..world).map(|r| shard_name(r, world)).collect();
    want.push("config.json".into());
    want.sort();
    assert_eq!(names, want);
}

/// Checks the bucket holds versions 0..=step, one per step, each recording
/// its step, anchors every 3 versions, and no records left in `parts/`.
async fn assert_versions(store: &Store, step: u64) {
    let versions = versions_after(store, None).await.unwrap();
    assert_eq!(versions, (0..=step).collect::<Vec<_>>());
    for v in versions {
        let m = read_manifest(store, v).await.unwrap().unwrap();
        assert_eq!(m.step, Some(v), "version {v} holds step {v}");
        let want = if v % 3 == 0 {
            VersionKind::Anchor
        } else {
            VersionKind::Delta
        };
        assert_eq!(m.kind, want, "version {v}");
    }
    assert_eq!(
        store.list("parts").await.unwrap(),
        vec![],
        "parts cleaned up"
    );
}

#[test]
fn two_ranks_publish_one_version_per_step() {
    // Each rank's checkpoint is a step directory of its own, so the ranks
    // can also keep no copy (`--state-mode previous`).
    for mode in [None, Some("previous")] {
        two_ranks_in(mode);
    }
}

fn two_ranks_in(mode: Option<&str>) {
    let work = tempfile::tempdir().unwrap();
    let bucket = work.path().join("bucket");
    std::fs::create_dir_all(&bucket).unwrap();
    let url = url::Url::from_directory_path(&bucket).unwrap().to_string();
    let store = Store::open(&url).unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let ranks: Vec<Rank> = (0..2)
        .map(|r| Rank {
            url: &url,
            env: &[],
            state: work.path().join(format!("state-{r}")),
            rank: r,
            world: 2,
            mode,
        })
        .collect();
    let mut g = Generator::new(GeneratorConfig::tiny(21));
    let sub = work.path().join("sub");
    for step in 0..5u64 {
        if step > 0 {
            g.step();
        }
        let dirs = write_step(work.path(), &g, step, 2);
        // Both ranks at once, as two trainer processes would.
        let children: Vec<Child> = ranks
            .iter()
            .zip(&dirs)
            .map(|(r, d)| r.spawn(d, step))
            .collect();
        for (r, c) in children.into_iter().enumerate() {
            let out = published(c.wait_with_output().unwrap(), &format!("rank {r}"));
            assert_eq!(out["version"], step, "rank {r}: {out}");
            assert_eq!(out["step"], step, "rank {r}: {out}");
            let kind = if step % 3 == 0 { "anchor" } else { "delta" };
            assert_eq!(out["kind"], kind, "{mode:?} rank {r}, step {step}: {out}");
        }
        if mode.is_some() {
            assert!(
                !work.path().join("state-0/snapshot").exists(),
                "no copy of the rank's shard"
            );
        }
        rt.block_on(async {
            assert_versions(&store, step).await;
            assert_subscriber_exact(&store, &sub, &g.snapshot(), (step, step), 2).await;
        });
    }
    // A rank rerun at the step just committed (say, restarted after the
    // commit) answers that version without writing anything.
    let dirs = write_step(work.path(), &g, 4, 2);
    let again = published(
        ranks[1].command(&dirs[1], 4, None).output().unwrap(),
        "rerun",
    );
    assert_eq!(again["version"], 4, "{again}");
    assert_eq!(again["unchanged"], true, "{again}");
    rt.block_on(assert_versions(&store, 4));
}

/// `moto_options` as the environment the binary reads them from.
fn moto_env() -> Vec<(String, String)> {
    common::moto_options()
        .into_iter()
        .map(|(k, v)| (k.to_uppercase(), v))
        .collect()
}

#[test]
#[cfg_attr(
    not(feature = "failpoints"),
    ignore = "needs --features failpoints (scripts/test.sh enables it)"
)]
fn four_ranks_on_moto_survive_a_rank_killed_mid_upload() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let url = "s3://dist4/run".to_string();
    let store = rt.block_on(common::moto_store("dist4", "run"));
    let env = moto_env();
    let work = tempfile::tempdir().unwrap();
    let ranks: Vec<Rank> = (0..4)
        .map(|r| Rank {
            url: &url,
            env: &env,
            state: work.path().join(format!("state-{r}")),
            rank: r,
            world: 4,
            mode: None,
        })
        .collect();
    let mut g = Generator::new(GeneratorConfig::tiny(22));
    let sub = work.path().join("sub");
    let all = |dirs: &[PathBuf], step: u64, skip: Option<u32>| -> Vec<(u32, Child)> {
        ranks
            .iter()
            .zip(dirs)
            .filter(|(r, _)| Some(r.rank) != skip)
            .map(|(r, d)| (r.rank, r.spawn(d, step)))
            .collect()
    };
    let finish = |children: Vec<(u32, Child)>, step: u64, kind: &str| {
        for (r, c) in children {
            let out = published(c.wait_with_output().unwrap(), &format!("rank {r}"));
            assert_eq!(out["version"], step, "rank {r}: {out}");
            assert_eq!(out["kind"], kind, "rank {r}: {out}");
        }
    };

    let dirs = write_step(work.path(), &g, 0, 4);
    finish(all(&dirs, 0, None), 0, "anchor");
    rt.block_on(assert_subscriber_exact(
        &store,
        &sub,
        &g.snapshot(),
        (0, 0),
        4,
    ));

    // Step 1: rank 3 dies after its first upload, the others wait.
    let step0 = g.snapshot();
    g.step();
    let dirs = write_step(work.path(), &g, 1, 4);
    let waiting = all(&dirs, 1, Some(3));
    let killed = ranks[3]
        .command(&dirs[3], 1, Some("publisher.mid_upload"))
        .output()
        .unwrap();
    assert!(
        !killed.status.success(),
        "the failpoint did not stop rank 3"
    );
    assert!(
        String::from_utf8_lossy(&killed.stderr).contains("publisher.mid_upload"),
        "{}",
        String::from_utf8_lossy(&killed.stderr)
    );
    rt.block_on(async {
        // Rank 3's first object is there, the version is not.
        let uploaded = store.list("deltas").await.unwrap();
        assert!(
            uploaded
                .iter()
                .any(|l| l.key.starts_with("deltas/00000000000000000001-")
                    && l.key.ends_with(&shard_name(3, 4))),
            "rank 3 uploaded nothing before it died: {uploaded:?}"
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert_eq!(versions_after(&store, None).await.unwrap(), vec![0]);
        let latest = weightcast::protocol::read_latest(&store, None)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(latest.0.version, 0);
        // A subscriber sees nothing new.
        assert_subscriber_exact(&store, &sub, &step0, (0, 0), 4).await;
    });
    // Restarted with the same step, rank 3 completes the version.
    let restarted = ranks[3].spawn(&dirs[3], 1);
    finish(vec![(3, restarted)], 1, "delta");
    finish(waiting, 1, "delta");
    rt.block_on(assert_subscriber_exact(
        &store,
        &sub,
        &g.snapshot(),
        (1, 1),
        4,
    ));

    // Every rank's snapshot stayed trusted: the next step is a delta.
    g.step();
    let dirs = write_step(work.path(), &g, 2, 4);
    finish(all(&dirs, 2, None), 2, "delta");
    rt.block_on(async {
        assert_versions(&store, 2).await;
        assert_subscriber_exact(&store, &sub, &g.snapshot(), (2, 2), 4).await;
    });

    // Step 3 (an anchor): rank 2 dies right after writing its part. The
    // others commit the version with it; restarted, rank 2 finds its pending
    // commit done, brings its snapshot to it and answers that version.
    g.step();
    let dirs = write_step(work.path(), &g, 3, 4);
    let others = all(&dirs, 3, Some(2));
    let killed = ranks[2]
        .command(&dirs[2], 3, Some("publisher.after_part"))
        .output()
        .unwrap();
    assert!(
        !killed.status.success(),
        "the failpoint did not stop rank 2"
    );
    finish(others, 3, "anchor");
    let again = published(
        ranks[2].command(&dirs[2], 3, None).output().unwrap(),
        "rank 2 restarted",
    );
    assert_eq!(again["version"], 3, "{again}");
    assert_eq!(again["unchanged"], true, "{again}");
    rt.block_on(assert_subscriber_exact(
        &store,
        &sub,
        &g.snapshot(),
        (3, 3),
        4,
    ));
    // Its snapshot is the committed version: the next step is a delta.
    g.step();
    let dirs = write_step(work.path(), &g, 4, 4);
    finish(all(&dirs, 4, None), 4, "delta");
    rt.block_on(async {
        assert_versions(&store, 4).await;
        assert_subscriber_exact(&store, &sub, &g.snapshot(), (4, 4), 4).await;
    });
}

/// Two in-process ranks on a local bucket, each with its own checkpoint.
async fn two_ranks(
    store: &Store,
    work: &Path,
    cps: [Checkpoint; 2],
    steps: [u64; 2],
) -> [weightcast::Result<weightcast::publisher::Published>; 2] {
    let [c0, c1] = cps;
    let run = |rank: u32, cp: Checkpoint, step: u64| {
        let store = store.clone();
        let mut cfg = common::publisher_config(&work.join(format!("state-{rank}")), 10, None);
        cfg.distributed = Some(Distributed {
            timeout: Duration::from_secs(3),
            ..Distributed::new(rank, 2).unwrap()
        });
        async move {
            let mut p = Publisher::open(store, cfg).await?;
            p.publish(cp, &PublishOptions { step: Some(step) }).await
        }
    };
    let (a, b) = tokio::join!(run(0, c0, steps[0]), run(1, c1, steps[1]));
    [a, b]
}

fn checkpoint(file: &str, set: TensorSet) -> Checkpoint {
    Checkpoint::from_sets([(file.to_string(), set)].into(), BTreeMap::new()).unwrap()
}

#[tokio::test]
async fn a_tensor_name_on_two_ranks_is_refused() {
    let (store, _bucket) = common::local_store();
    let work = tempfile::tempdir().unwrap();
    let set = Generator::new(GeneratorConfig::tiny(23)).snapshot();
    let a = shard(&set, 0, 2);
    // Rank 1's shard also holds rank 0's first tensor.
    let dup = a.tensors()[0].name.clone();
    let mut b = shard(&set, 1, 2);
    b = TensorSet::merge(vec![
        b,
        TensorSet::from_tensors([(
            dup.clone(),
            a.tensors()[0].dtype,
            a.tensors()[0].shape.clone(),
            a.data(0).to_vec(),
        )])
        .unwrap(),
    ])
    .unwrap();
    let [r0, r1] = two_ranks(
        &store,
        work.path(),
        [
            checkpoint(&shard_name(0, 2), a),
            checkpoint(&shard_name(1, 2), b),
        ],
        [7, 7],
    )
    .await;
    for (r, res) in [(0, r0), (1, r1)] {
        let e = res
            .expect_err("a duplicate tensor name must be refused")
            .to_string();
        assert!(
            e.contains(&format!("tensor `{dup}`")) && e.contains("rank 0") && e.contains("rank 1"),
            "rank {r}: {e}"
        );
    }
    assert!(versions_after(&store, None).await.unwrap().is_empty());

    // The failed attempt is withdrawn: rank 0 rerun alone starts a new
    // attempt and waits for rank 1's new intent (rather than meeting the
    // failed attempt's parts again).
    let mut p0 = open_rank(&store, work.path(), 0, 1).await;
    let e = p0
        .publish(
            checkpoint(&shard_name(0, 2), shard(&set, 0, 2)),
            &PublishOptions { step: Some(7) },
        )
        .await
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("gave up") && e.contains("intents of ranks [1]"),
        "{e}"
    );
    drop(p0);
    // Fixed (rank 1 drops the duplicate), the same step publishes: the failed
    // attempt's parts do not count.
    let [r0, r1] = two_ranks(
        &store,
        work.path(),
        [
            checkpoint(&shard_name(0, 2), shard(&set, 0, 2)),
            checkpoint(&shard_name(1, 2), shard(&set, 1, 2)),
        ],
        [7, 7],
    )
    .await;
    assert_eq!(r0.unwrap().version, 0);
    assert_eq!(r1.unwrap().version, 0);
    let m = read_manifest(&store, 0).await.unwrap().unwrap();
    assert_eq!(m.objects.len(), 2, "{m:?}");
}

#[tokio::test]
async fn mismatched_steps_are_refused() {
    let (store, _bucket) = common::local_store();
    let work = tempfile::tempdir().unwrap();
    let set = Generator::new(GeneratorConfig::tiny(24)).snapshot();
    let [r0, r1] = two_ranks(
        &store,
        work.path(),
        [
            checkpoint(&shard_name(0, 2), shard(&set, 0, 2)),
            checkpoint(&shard_name(1, 2), shard(&set, 1, 2)),
        ],
        [5, 6],
    )
    .await;
    // Rank 0 sees the newer step and stops; rank 1 waits for rank 0's step 6
    // until its timeout.
    let e0 = r0.unwrap_err().to_string();
    assert!(
        e0.contains("mismatched steps") && e0.contains("step 6"),
        "{e0}"
    );
    let e1 = r1.unwrap_err().to_string();
    assert!(e1.contains("gave up on version 0"), "{e1}");
    assert!(versions_after(&store, None).await.unwrap().is_empty());

    // A distributed publish needs a step.
    let mut cfg = common::publisher_config(&work.path().join("state-x"), 10, None);
    cfg.distributed = Some(Distributed::new(0, 2).unwrap());
    let mut p = Publisher::open(store.clone(), cfg).await.unwrap();
    let e = p
        .publish(
            checkpoint(&shard_name(0, 2), shard(&set, 0, 2)),
            &PublishOptions::default(),
        )
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("--step"), "{e}");
    assert!(Distributed::new(2, 2).is_err() && Distributed::new(0, 1).is_err());
}

#[tokio::test]
async fn gc_removes_parts_that_can_no_longer_commit() {
    use weightcast::protocol::parts::{INTENT_FORMAT, Intent, intent_key, write_record};
    let (store, _bucket) = common::local_store();
    let work = tempfile::tempdir().unwrap();
    let mut p = Publisher::open(
        store.clone(),
        common::publisher_config(work.path(), 10, None),
    )
    .await
    .unwrap();
    p.publish(
        common::Trainer::new(25).checkpoint(),
        &PublishOptions::default(),
    )
    .await
    .unwrap();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    // Version 0 is committed: its records are dead. Version 1's are fresh (a
    // publish in flight); version 2's are two hours old (abandoned).
    for (version, created_at) in [(0u64, now), (1, now), (2, now - 7200)] {
        let intent = Intent {
            format: INTENT_FORMAT.into(),
            version,
            rank: 0,
            world: 2,
            step: version,
            token: "0123456789abcdef".into(),
            anchor: None,
            created_at,
        };
        write_record(&store, &intent_key(version, 0), &intent)
            .await
            .unwrap();
    }
    let keep = weightcast::protocol::Retention {
        keep_anchors: 1,
        registration_max_age_s: None,
    };
    let dry = weightcast::protocol::collect_garbage(&store, &keep, true)
        .await
        .unwrap();
    assert_eq!(dry.objects, 2, "{dry:?}");
    assert_eq!(
        store.list("parts").await.unwrap().len(),
        3,
        "a dry run removes nothing"
    );
    weightcast::protocol::collect_garbage(&store, &keep, false)
        .await
        .unwrap();
    let left: Vec<String> = store
        .list("parts")
        .await
        .unwrap()
        .into_iter()
        .map(|l| l.key)
        .collect();
    assert_eq!(left, vec![intent_key(1, 0)]);
    assert_eq!(versions_after(&store, None).await.unwrap(), vec![0]);
}

/// Rank `rank` of 2 as an in-process publisher with a short timeout.
async fn open_rank(store: &Store, work: &Path, rank: u32, timeout_s: u64) -> Publisher {
    let mut cfg = common::publisher_config(&work.join(format!("state-{rank}")), 10, None);
    cfg.distributed = Some(Distributed {
        timeout: Duration::from_secs(timeout_s),
        ..Distributed::new(rank, 2).unwrap()
    });
    Publisher::open(store.clone(), cfg).await.unwrap()
}

/// Rank `rank`'s checkpoint of `set` at `step`: its shard and config.json.
fn rank_checkpoint(set: &TensorSet, rank: u32, step: u64) -> Checkpoint {
    Checkpoint::from_sets(
        [(shard_name(rank, 2), shard(set, rank, 2))].into(),
        [("config.json".to_string(), bytes::Bytes::from(config(step)))].into(),
    )
    .unwrap()
}

#[tokio::test]
async fn an_abandoned_step_is_overwritten_and_any_rank_needing_an_anchor_makes_one() {
    let (store, _bucket) = common::local_store();
    let work = tempfile::tempdir().unwrap();
    let sub = work.path().join("sub");
    let mut g = Generator::new(GeneratorConfig::tiny(26));
    let both = |set: TensorSet, step: u64| {
        let store = store.clone();
        let work = work.path().to_path_buf();
        async move {
            let run = |rank: u32| {
                let (store, work, set) = (store.clone(), work.clone(), set.clone());
                async move {
                    let mut p = open_rank(&store, &work, rank, 60).await;
                    p.publish(
                        rank_checkpoint(&set, rank, step),
                        &PublishOptions { step: Some(step) },
                    )
                    .await
                    .unwrap()
                }
            };
            let (a, b) = tokio::join!(run(0), run(1));
            assert_eq!((a.version, a.kind), (b.version, b.kind), "{a:?} {b:?}");
            a
        }
    };
    let p = both(g.snapshot(), 0).await;
    assert_eq!((p.version, p.kind), (0, VersionKind::Anchor));

    // Step 1: rank 1 never comes; rank 0 gives up, nothing is committed.
    g.step();
    let mut r0 = open_rank(&store, work.path(), 0, 1).await;
    let e = r0
        .publish(
            rank_checkpoint(&g.snapshot(), 0, 1),
            &PublishOptions { step: Some(1) },
        )
        .await
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("gave up on version 1") && e.contains("[1]"),
        "{e}"
    );
    drop(r0);
    assert_eq!(versions_after(&store, None).await.unwrap(), vec![0]);

    // Step 2: both ranks; rank 0's stale intent of step 1 is replaced and
    // version 1 holds step 2, a delta (both snapshots still trusted).
    g.step();
    let p = both(g.snapshot(), 2).await;
    assert_eq!((p.version, p.kind), (1, VersionKind::Delta), "{p:?}");
    let m = read_manifest(&store, 1).await.unwrap().unwrap();
    assert_eq!(m.step, Some(2));
    assert_eq!(m.files.len(), 1, "config.json listed once: {m:?}");
    assert_subscriber_exact(&store, &sub, &g.snapshot(), (1, 2), 2).await;

    // Rank 1 loses its state: it needs an anchor, so the version is an
    // anchor for both, without bridges (rank 1 has none).
    std::fs::remove_dir_all(work.path().join("state-1")).unwrap();
    g.step();
    let p = both(g.snapshot(), 3).await;
    assert_eq!((p.version, p.kind), (2, VersionKind::Anchor), "{p:?}");
    assert!(
        p.anchor_reason
            .as_deref()
            .unwrap_or("")
            .starts_with("rank 1:"),
        "{p:?}"
    );
    let m = read_manifest(&store, 2).await.unwrap().unwrap();
    assert_eq!(m.base_version, None, "unbridged: {m:?}");
    assert_subscriber_exact(&store, &sub, &g.snapshot(), (2, 3), 2).await;

    // And the next step is a delta again for both.
    g.step();
    let p = both(g.snapshot(), 4).await;
    assert_eq!((p.version, p.kind), (3, VersionKind::Delta), "{p:?}");
    assert_subscriber_exact(&store, &sub, &g.snapshot(), (3, 4), 2).await;
}

#[tokio::test]
async fn two_publisher_daemons_publish_one_version_per_step() {
    const TOKEN: &str = "test-token-0123456789";
    let (store, _bucket) = common::local_store();
    let work = tempfile::tempdir().unwrap();
    let root = work.path().join("checkpoints");
    std::fs::create_dir_all(&root).unwrap();
    let mut bases = Vec::new();
    for rank in 0..2 {
        let p = open_rank(&store, work.path(), rank, 60).await;
        let shared =
            weightcast::http::publisher::PublisherShared::new(p, TOKEN, &root, Default::default())
                .unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        bases.push(format!("http://{}", listener.local_addr().unwrap()));
        tokio::spawn(weightcast::http::publisher::serve(
            listener,
            shared,
            std::future::pending(),
        ));
    }
    let client = common::http_client();
    let post = |rank: usize, body: serde_json::Value| {
        client
            .post(format!("{}/v1/publish", bases[rank]))
            .header("authorization", format!("Bearer {TOKEN}"))
            .json(&body)
            .send()
    };
    let mut g = Generator::new(GeneratorConfig::tiny(27));
    let sub = work.path().join("sub");
    for step in 0..3u64 {
        if step > 0 {
            g.step();
        }
        let dirs = write_step(&root, &g, step, 2);
        let (a, b) = tokio::join!(
            post(0, serde_json::json!({"checkpoint": dirs[0], "step": step})),
            post(1, serde_json::json!({"checkpoint": dirs[1], "step": step})),
        );
        for r in [a.unwrap(), b.unwrap()] {
            assert!(r.status().is_success(), "{}", r.status());
            let out: serde_json::Value = r.json().await.unwrap();
            assert_eq!(out["version"], step, "{out}");
        }
        assert_subscriber_exact(&store, &sub, &g.snapshot(), (step, step), 2).await;
    }
    // Without a step, a rank refuses the request and touches nothing.
    let dirs = write_step(&root, &g, 9, 2);
    let r = post(0, serde_json::json!({"checkpoint": dirs[0]}))
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 422);
    assert!(r.text().await.unwrap().contains("step"));
    assert_eq!(versions_after(&store, None).await.unwrap(), vec![0, 1, 2]);
}

/// Rank `rank` of `world` as an in-process publisher with a short timeout,
/// its state under `work`.
async fn open_rank_of(
    store: &Store,
    work: &Path,
    rank: u32,
    world: u32,
    timeout_s: u64,
) -> Publisher {
    let mut cfg = common::publisher_config(&work.join(format!("state-{rank}")), 10, None);
    cfg.distributed = Some(Distributed {
        timeout: Duration::from_secs(timeout_s),
        ..Distributed::new(rank, world).unwrap()
    });
    Publisher::open(store.clone(), cfg).await.unwrap()
}

/// Rank `rank`'s checkpoint of `set` split `shards` ways, at `step`.
fn shard_checkpoint(set: &TensorSet, rank: u32, shards: u32, step: u64) -> Checkpoint {
    Checkpoint::from_sets(
        [(shard_name(rank, shards), shard(set, rank, shards))].into(),
        [("config.json".to_string(), bytes::Bytes::from(config(step)))].into(),
    )
    .unwrap()
}

/// `ranks` of `world` publish their shards (of `shards`) of `set` at
/// `step`, concurrently; every rank must succeed with the same version and
/// kind, which is returned.
async fn all_publish(
    store: &Store,
    work: &Path,
    (ranks, world, shards): (&[u32], u32, u32),
    set: &TensorSet,
    step: u64,
) -> weightcast::publisher::Published {
    let runs = ranks.iter().map(|&r| {
        let (store, work, set) = (store.clone(), work.to_path_buf(), set.clone());
        async move {
            let mut p = open_rank_of(&store, &work, r, world, 60).await;
            p.publish(
                shard_checkpoint(&set, r, shards, step),
                &PublishOptions { step: Some(step) },
            )
            .await
            .unwrap_or_else(|e| panic!("rank {r} at step {step}: {e}"))
        }
    });
    let out = futures::future::join_all(runs).await;
    for o in &out {
        assert_eq!(
            (o.version, o.kind),
            (out[0].version, out[0].kind),
            "{out:?}"
        );
    }
    out.into_iter().next().unwrap()
}

/// Issue 30, defect 2: a rank that republishes a committed step with other
/// weights was told `{"unchanged": true}` and its weights went nowhere. A
/// rank's content is part of its identity: other content for a committed
/// step is refused (as a publisher alone refuses a step that is not newer);
/// the same content still answers the committed version.
#[tokio::test]
async fn a_rank_republishing_a_committed_step_with_new_content_is_refused() {
    let (store, _bucket) = common::local_store();
    let work = tempfile::tempdir().unwrap();
    let mut g = Generator::new(GeneratorConfig::tiny(28));
    for step in 0..3u64 {
        if step > 0 {
            g.step();
        }
        let p = all_publish(&store, work.path(), (&[0, 1], 2, 2), &g.snapshot(), step).await;
        assert_eq!(p.version, step);
    }
    let committed = g.snapshot();
    g.step();
    let mut r0 = open_rank_of(&store, work.path(), 0, 2, 2).await;
    let e = r0
        .publish(
            shard_checkpoint(&g.snapshot(), 0, 2, 2),
            &PublishOptions { step: Some(2) },
        )
        .await
        .expect_err("new content for a committed step must not be 'unchanged'");
    assert_eq!(e.kind(), weightcast::error::ErrorKind::Precondition, "{e}");
    let msg = e.to_string();
    assert!(
        msg.contains("step 2 is already committed as version 2") && msg.contains("newer --step"),
        "{msg}"
    );
    // A non-tensor file that differs is other content too.
    let other_config = Checkpoint::from_sets(
        [(shard_name(0, 2), shard(&committed, 0, 2))].into(),
        [("config.json".to_string(), bytes::Bytes::from("{}"))].into(),
    )
    .unwrap();
    let e = r0
        .publish(other_config, &PublishOptions { step: Some(2) })
        .await
        .unwrap_err();
    assert!(e.to_string().contains("non-tensor files differ"), "{e}");
    // The content it committed: the committed version, unchanged.
    let same = r0
        .publish(
            shard_checkpoint(&committed, 0, 2, 2),
            &PublishOptions { step: Some(2) },
        )
        .await
        .unwrap();
    assert!(same.unchanged && same.version == 2, "{same:?}");
    assert_eq!(versions_after(&store, None).await.unwrap(), vec![0, 1, 2]);
}

/// Issue 30, defect 3: rank 0 dies after writing its part; restarted with
/// other weights (a nondeterministic kernel), it reused its intent — the
/// same writer, the same keys — rewrote an object its part names, and died
/// before its new part; rank 1 then committed the version from the old part,
/// whose BLAKE3 no longer matched, and every subscriber quarantined it. A
/// restarted rank never writes other bytes to a key its part names: the
/// new content is refused before anything is uploaded, and the version
/// commits from the first attempt's part, readable.
#[test]
fn a_restarted_rank_never_rewrites_an_object_its_part_names() {
    let work = tempfile::tempdir().unwrap();
    let bucket = work.path().join("bucket");
    std::fs::create_dir_all(&bucket).unwrap();
    let url = url::Url::from_directory_path(&bucket).unwrap().to_string();
    let store = Store::open(&url).unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let ranks: Vec<Rank> = (0..2)
        .map(|r| Rank {
            url: &url,
            env: &[],
            state: work.path().join(format!("state-{r}")),
            rank: r,
            world: 2,
            mode: None,
        })
        .collect();
    let mut g = Generator::new(GeneratorConfig::tiny(29));
    let sub = work.path().join("sub");
    // Steps 0..=3 (anchors at 0 and 3), both ranks.
    for step in 0..4u64 {
        if step > 0 {
            g.step();
        }
        let dirs = write_step(work.path(), &g, step, 2);
        let children: Vec<Child> = ranks
            .iter()
            .zip(&dirs)
            .map(|(r, d)| r.spawn(d, step))
            .collect();
        for (r, c) in children.into_iter().enumerate() {
            let out = published(c.wait_with_output().unwrap(), &format!("rank {r}"));
            assert_eq!(out["version"], step, "rank {r}: {out}");
        }
    }
    // Step 4 (a delta): rank 0 writes its part and dies; rank 1 dies before
    // its own (both had written their intents).
    g.step();
    let step4 = g.snapshot();
    let dirs = write_step(work.path(), &g, 4, 2);
    let r1 = ranks[1]
        .command(&dirs[1], 4, Some("publisher.mid_upload"))
        .spawn()
        .unwrap();
    let killed = ranks[0]
        .command(&dirs[0], 4, Some("publisher.after_part"))
        .output()
        .unwrap();
    assert!(
        !killed.status.success(),
        "the failpoint did not stop rank 0"
    );
    assert!(
        !r1.wait_with_output().unwrap().status.success(),
        "the failpoint did not stop rank 1"
    );
    assert_eq!(
        rt.block_on(versions_after(&store, None)).unwrap(),
        vec![0, 1, 2, 3]
    );
    // Restarted at step 4 with other weights, set to die after its first
    // upload: it must refuse before uploading anything.
    let mut h = Generator::new(GeneratorConfig::tiny(29));
    for _ in 0..5 {
        h.step();
    }
    let other = work.path().join("other/rank-0");
    std::fs::create_dir_all(&other).unwrap();
    shard(&h.snapshot(), 0, 2)
        .write_to(
            &BTreeMap::new(),
            &mut std::fs::File::create(other.join(shard_name(0, 2))).unwrap(),
        )
        .unwrap();
    std::fs::write(other.join("config.json"), config(4)).unwrap();
    let again = ranks[0]
        .command(&other, 4, Some("publisher.mid_upload"))
        .output()
        .unwrap();
    // Rank 1 commits version 4 from rank 0's first part: every object is
    // the one its manifest names, and a subscriber reads exactly step 4.
    let out = published(
        ranks[1].command(&dirs[1], 4, None).output().unwrap(),
        "rank 1",
    );
    assert_eq!(out["version"], 4, "{out}");
    rt.block_on(async {
        let m = read_manifest(&store, 4).await.unwrap().unwrap();
        for o in &m.objects {
            assert_eq!(
                store.measure(&o.key).await.unwrap(),
                Some((o.size, o.blake3.clone())),
                "{} no longer matches the committed manifest",
                o.key
            );
        }
        assert_subscriber_exact(&store, &sub, &step4, (4, 4), 2).await;
    });
    // The restarted rank 0 was refused before uploading anything.
    let stderr = String::from_utf8_lossy(&again.stderr);
    assert_eq!(again.status.code(), Some(75), "{stderr}");
    assert!(
        stderr.contains("this content is refused") && stderr.contains("rank-0-of-2.json"),
        "{stderr}"
    );
    // Rank 0 with its other weights at step 4: that step is taken.
    let late = ranks[0].command(&other, 4, None).output().unwrap();
    assert_eq!(late.status.code(), Some(75));
    // Step 5: every rank moves on (rank 0's snapshot was left behind by the
    // commit it did not see: an anchor), exact.
    g.step();
    let dirs = write_step(work.path(), &g, 5, 2);
    let children: Vec<Child> = ranks
        .iter()
        .zip(&dirs)
        .map(|(r, d)| r.spawn(d, 5))
        .collect();
    for (r, c) in children.into_iter().enumerate() {
        let out = published(c.wait_with_output().unwrap(), &format!("rank {r}"));
        assert_eq!(
            (&out["version"], &out["kind"]),
            (&5.into(), &"anchor".into()),
            "{out}"
        );
    }
    rt.block_on(assert_subscriber_exact(
        &store,
        &sub,
        &g.snapshot(),
        (5, 5),
        2,
    ));
}

/// Issue 30, defect 4: after three-rank versions, two ranks publish with
/// `--world 2`, each with the shard it had. Every rank's own files were
/// unchanged, so each made a delta, and the version had no object for the
/// third shard: every subscriber quarantined it. The number of ranks is
/// part of a rank's snapshot: when it changes the version is an anchor (as
/// a publisher alone makes one when its files change), and a delta whose
/// files are not its base's is never committed.
#[tokio::test]
async fn ranks_leaving_the_world_make_an_anchor() {
    let (store, _bucket) = common::local_store();
    let work = tempfile::tempdir().unwrap();
    let sub = work.path().join("sub");
    let mut g = Generator::new(GeneratorConfig::tiny(31));
    // Holds exactly shards `ranks` (of 3) of `set` and config.json of `step`.
    let exact = |set: TensorSet, ranks: Vec<u32>, version: u64, step: u64| {
        let (store, sub) = (store.clone(), sub.clone());
        async move {
            let c = weightcast::subscriber::catch_up(&store, &sub)
                .await
                .unwrap()
                .unwrap();
            assert_eq!(c.version, version, "{c:?}");
            let cur = sub.join("current");
            let mut want: Vec<String> = ranks.iter().map(|&r| shard_name(r, 3)).collect();
            want.push("config.json".into());
            want.sort();
            let mut names: Vec<String> = std::fs::read_dir(&cur)
                .unwrap()
                .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect();
            names.sort();
            assert_eq!(names, want, "version {version}");
            for r in ranks {
                let got = TensorSet::read(&cur.join(shard_name(r, 3)), Digests::Compute).unwrap();
                let w = shard(&set, r, 3);
                assert_eq!(got.len(), w.len());
                for (i, t) in w.tensors().iter().enumerate() {
                    let j = got.position(&t.name).unwrap();
                    assert!(got.data(j) == w.data(i), "version {version}: {}", t.name);
                }
            }
            assert_eq!(
                std::fs::read_to_string(cur.join("config.json")).unwrap(),
                config(step)
            );
        }
    };
    for step in 0..2u64 {
        if step > 0 {
            g.step();
        }
        let p = all_publish(&store, work.path(), (&[0, 1, 2], 3, 3), &g.snapshot(), step).await;
        assert_eq!(p.version, step);
        exact(g.snapshot(), vec![0, 1, 2], step, step).await;
    }
    // Rank 2 leaves: ranks 0 and 1 go on with --world 2 and their shards.
    g.step();
    let p = all_publish(&store, work.path(), (&[0, 1], 2, 3), &g.snapshot(), 2).await;
    assert_eq!((p.version, p.kind), (2, VersionKind::Anchor), "{p:?}");
    assert!(
        p.anchor_reason
            .as_deref()
            .is_some_and(|r| r.contains("number of ranks changed from 3 to 2")),
        "{p:?}"
    );
    exact(g.snapshot(), vec![0, 1], 2, 2).await;
    // And deltas again after it.
    g.step();
    let p = all_publish(&store, work.path(), (&[0, 1], 2, 3), &g.snapshot(), 3).await;
    assert_eq!((p.version, p.kind), (3, VersionKind::Delta), "{p:?}");
    exact(g.snapshot(), vec![0, 1], 3, 3).await;
}
