//! One-shot commands cost what the daemon costs (issue 27): local state is
//! trusted between runs by recorded stamps, verified in full when a stamp
//! differs or on request (`weightcast verify`); the publisher's snapshot on a
//! disk is the anchor's files plus an overlay of the deltas since, written in
//! proportion to the changes; a `--once` bootstrap fills the empty standby
//! slot so that the first delta after it costs its changes. And the bad
//! input: content changed under a matching stamp, a torn overlay.

use crate::common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use weightcast::format::Encoding;
use weightcast::fsio::Stamp;
use weightcast::generator::{Generator, GeneratorConfig};
use weightcast::publisher::state::Check;
use weightcast::publisher::{AnchorEncoding, Publisher, PublisherConfig, StateMode};
use weightcast::store::Store;
use weightcast::subscriber::{DirSink, catch_up};
use weightcast::tensors::{Digests, TensorSet};

struct Trainer {
    g: Generator,
    work: PathBuf,
    state: PathBuf,
    mode: StateMode,
    encoding: Encoding,
    anchor_encoding: AnchorEncoding,
    store: Store,
    publisher: Option<Publisher>,
    published: Vec<PathBuf>,
}

impl Trainer {
    async fn new(store: &Store, work: &Path, mode: StateMode) -> Trainer {
        let mut t = Trainer {
            g: Generator::new(GeneratorConfig::tiny(27)),
            work: work.to_path_buf(),
            state: work.join("pub-state"),
            mode,
            encoding: Encoding::Compact,
            anchor_encoding: AnchorEncoding::Planes,
            store: store.clone(),
            publisher: None,
            published: Vec::new(),
        };
        t.reopen().await;
        t
    }

    fn cfg(&self) -> PublisherConfig {
        PublisherConfig {
            state_mode: self.mode,
            encoding: self.encoding,
            anchor_encoding: self.anchor_encoding,
            ..common::publisher_config(&self.state, 100, None)
        }
    }

    /// A new process, as a one-shot `weightcast publish` is.
    async fn reopen(&mut self) -> Option<(Check, StateMode)> {
        self.publisher = None;
        let p = Publisher::open(self.store.clone(), self.cfg())
            .await
            .unwrap();
        let s = p.snapshot();
        self.publisher = Some(p);
        s
    }

    /// The next checkpoint (the first as it is, then one training step each).
    fn checkpoint(&mut self) -> PathBuf {
        if !self.published.is_empty() {
            self.g.step();
        }
        let dir = self.work.join(format!("ckpt-{}", self.published.len()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut f = std::fs::File::create(dir.join("model.safetensors")).unwrap();
        self.g
            .snapshot()
            .write_to(&BTreeMap::new(), &mut f)
            .unwrap();
        std::fs::write(dir.join("config.json"), b"{}").unwrap();
        dir
    }

    async fn publish(&mut self, dir: &Path) -> weightcast::publisher::Published {
        let p = self.publisher.as_mut().unwrap();
        let out = p.publish_path(dir, &Default::default()).await.unwrap();
        self.published.push(dir.to_path_buf());
        out
    }

    async fn step(&mut self) -> weightcast::publisher::Published {
        let dir = self.checkpoint();
        self.publish(&dir).await
    }

    /// The file the publisher's last version is in: its snapshot's, or in
    /// `previous` mode (past an anchor) the last checkpoint's own.
    fn snapshot_file(&self) -> PathBuf {
        let own = self.state.join("snapshot/model.safetensors");
        match self.published.last() {
            Some(dir) if self.mode == StateMode::Previous && !own.exists() => {
                dir.join("model.safetensors")
            }
            _ => own,
        }
    }
}

/// The subscriber's current checkpoint equals the trainer's, byte for byte.
fn assert_matches(out: &Path, ckpt: &Path) {
    let got = TensorSet::read(&out.join("current/model.safetensors"), Digests::Compute).unwrap();
    let want = TensorSet::read(&ckpt.join("model.safetensors"), Digests::Compute).unwrap();
    assert_eq!(got.digest(), want.digest());
    for (i, t) in want.tensors().iter().enumerate() {
        let j = got.position(&t.name).unwrap();
        assert!(got.data(j) == want.data(i), "{} differs", t.name);
    }
}

/// Flips the lowest bit of the byte at `offset` of `path` (a write through the
/// kernel: its stamp changes).
fn flip(path: &Path, offset: u64) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::File::options()
        .read(true)
        .write(true)
        .open(path)
        .unwrap();
    let mut b = [0u8];
    f.read_exact_at(&mut b, offset).unwrap();
    b[0] ^= 1;
    f.write_all_at(&b, offset).unwrap();
}

/// Where tensor data starts in a safetensors file.
fn data_start(path: &Path) -> u64 {
    let head = std::fs::read(path).unwrap();
    8 + u64::from_le_bytes(head[..8].try_into().unwrap())
}

/// Forges the stamps `state.json` records for the snapshot's files as they
/// are now: a stamp that matches while the content changed (what a disk
/// returning other bytes, or a tool that restores every time stamp, leaves).
fn forge_publisher_stamps(state: &Path) {
    std::thread::sleep(std::time::Duration::from_millis(20));
    let p = state.join("state.json");
    let mut j: serde_json::Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
    for (name, rec) in j["stamps"].as_object_mut().unwrap() {
        let (size, stamp) = Stamp::of(&state.join("snapshot").join(name)).unwrap();
        rec["size"] = size.into();
        rec["stamp"] = serde_json::to_value(stamp).unwrap();
    }
    std::fs::write(&p, serde_json::to_vec_pretty(&j).unwrap()).unwrap();
}

/// The same for a subscriber's output: the stamps of every slot's files.
fn forge_output_stamps(out: &Path) {
    std::thread::sleep(std::time::Duration::from_millis(20));
    let p = out.join(".state.json");
    let mut j: serde_json::Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
    for (slot, rec) in j["slots"].as_object_mut().unwrap() {
        for kind in ["tensors", "files"] {
            for (name, f) in rec[kind].as_object_mut().unwrap() {
                let path = out.join("slots").join(slot).join(name);
                let (_, stamp) = Stamp::of(&path).unwrap();
                f["stamp"] = serde_json::to_value(stamp).unwrap();
            }
        }
    }
    std::fs::write(&p, serde_json::to_vec_pretty(&j).unwrap()).unwrap();
}

/// A restarted publisher trusts its snapshot by the stamps it recorded
/// (nothing read), in both modes; a stamp that differs (the file rewritten,
/// even with the same bytes) means one full pass, and the snapshot stays
/// trusted when it verifies. Before issue 27 every start made the full pass.
#[tokio::test]
async fn a_restart_trusts_the_snapshot_by_its_stamps_or_verifies_it() {
    for mode in [StateMode::InPlace, StateMode::Overlay, StateMode::Previous] {
        let (store, _bucket) = common::local_store();
        let work = tempfile::tempdir().unwrap();
        let mut t = Trainer::new(&store, work.path(), mode).await;
        t.step().await;
        t.step().await;
        assert_eq!(
            t.reopen().await,
            Some((Check::Stamps, mode)),
            "{mode:?}: a restart reads nothing"
        );
        let out = t.step().await;
        assert_eq!(
            out.kind,
            weightcast::protocol::VersionKind::Delta,
            "{mode:?}"
        );

        // The same bytes written again: the stamp differs, one full pass.
        let f = t.snapshot_file();
        std::fs::write(&f, std::fs::read(&f).unwrap()).unwrap();
        assert_eq!(t.reopen().await, Some((Check::Full, mode)), "{mode:?}");
        let out = t.step().await;
        assert_eq!(
            out.kind,
            weightcast::protocol::VersionKind::Delta,
            "{mode:?}"
        );
        // ... and trusted by stamp again after that pass.
        assert_eq!(t.reopen().await, Some((Check::Stamps, mode)), "{mode:?}");

        let sub = work.path().join("sub");
        let c = catch_up(&store, &sub).await.unwrap().unwrap();
        assert_eq!(c.version, 3);
        assert_matches(&sub, t.published.last().unwrap());
    }
}

/// On a disk (the overlay), a delta version leaves the snapshot's files as
/// the anchor wrote them — same inode, times and bytes — and keeps the
/// version's delta objects beside them; a restart rebuilds the last version
/// from both. A torn overlay object (a crash, a disk) is found at the next
/// start: nothing is built on it, the next version is an anchor. Switching
/// to in place compacts the overlay into the files.
#[tokio::test]
async fn the_overlay_writes_the_changes_and_a_torn_one_means_an_anchor() {
    let (store, _bucket) = common::local_store();
    let work = tempfile::tempdir().unwrap();
    let mut t = Trainer::new(&store, work.path(), StateMode::Overlay).await;
    t.step().await; // v0 anchor
    let f = t.snapshot_file();
    let (anchor_bytes, anchor_stamp) = (std::fs::read(&f).unwrap(), Stamp::of(&f).unwrap());
    for _ in 1..=3 {
        let out = t.step().await;
        assert_eq!(out.kind, weightcast::protocol::VersionKind::Delta);
    }
    assert_eq!(Stamp::of(&f).unwrap(), anchor_stamp, "not written");
    assert_eq!(std::fs::read(&f).unwrap(), anchor_bytes);
    let overlay: Vec<String> = std::fs::read_dir(t.state.join("overlay"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(overlay.len(), 3, "{overlay:?}");

    // A restart: the anchor's files (by stamp) plus the overlay make v3.
    assert_eq!(t.reopen().await, Some((Check::Stamps, StateMode::Overlay)));
    let out = t.step().await; // v4
    assert_eq!(out.kind, weightcast::protocol::VersionKind::Delta);
    let sub = work.path().join("sub");
    catch_up(&store, &sub).await.unwrap().unwrap();
    assert_matches(&sub, &t.published[4]);

    // Torn: the second overlay version's object loses its tail.
    let torn = t
        .state
        .join(format!("overlay/{:020}/model.safetensors.delta", 2));
    let len = std::fs::metadata(&torn).unwrap().len();
    std::fs::File::options()
        .write(true)
        .open(&torn)
        .unwrap()
        .set_len(len / 2)
        .unwrap();
    assert_eq!(t.reopen().await, None, "nothing is built on a torn overlay");
    let out = t.step().await; // v5
    assert_eq!(out.kind, weightcast::protocol::VersionKind::Anchor);
    assert!(
        out.anchor_reason
            .as_deref()
            .unwrap()
            .contains("no trusted snapshot"),
        "{out:?}"
    );
    assert!(!t.state.join("overlay").exists(), "the anchor compacts it");
    let c = catch_up(&store, &sub).await.unwrap().unwrap();
    assert_eq!(c.version, 5);
    assert_matches(&sub, &t.published[5]);

    // Two overlay versions, then in place: compacted into the files.
    t.step().await;
    t.step().await;
    t.mode = StateMode::InPlace;
    assert_eq!(t.reopen().await, Some((Check::Stamps, StateMode::InPlace)));
    assert!(!t.state.join("overlay").exists());
    let want = TensorSet::read(&t.published[7].join("model.safetensors"), Digests::Compute)
        .unwrap()
        .digest();
    assert_eq!(
        TensorSet::read(&f, Digests::Compute).unwrap().digest(),
        want,
        "the files hold v7"
    );
    t.step().await; // v8, in place
    t.mode = StateMode::Overlay;
    assert_eq!(t.reopen().await, Some((Check::Stamps, StateMode::Overlay)));
    t.step().await; // v9, over the in-place files
    let c = catch_up(&store, &sub).await.unwrap().unwrap();
    assert_eq!((c.version, c.from_anchor), (9, false));
    assert_matches(&sub, &t.published[9]);
}

/// Bad input: the publisher's snapshot altered with its stamp restored (here
/// forged in `state.json`: a disk returning other bytes leaves the same). A
/// start trusts it; the next delta is made from the altered bytes. Which
/// check catches it: each subscriber's, in proportion to the changes — the
/// delta's changes do not reproduce its digests on the subscriber's own
/// verified base — so the version is refused (quarantined) and never served;
/// subscribers keep the last good version. `weightcast verify --state` (or
/// any stamp that differs) finds the alteration at the publisher, which then
/// publishes an anchor that moves everyone on.
#[tokio::test]
async fn a_snapshot_altered_under_a_matching_stamp_is_never_served() {
    for mode in [StateMode::InPlace, StateMode::Overlay] {
        let (store, _bucket) = common::local_store();
        let work = tempfile::tempdir().unwrap();
        let mut t = Trainer::new(&store, work.path(), mode).await;
        t.step().await; // v0
        t.step().await; // v1
        let sub = work.path().join("sub");
        let c = catch_up(&store, &sub).await.unwrap().unwrap();
        assert_eq!(c.version, 1);

        // The next checkpoint, and a byte no version so far nor the next
        // one changes.
        let v0 = TensorSet::read(&t.published[0].join("model.safetensors"), Digests::Skip).unwrap();
        let before = t.g.snapshot();
        let next = t.checkpoint();
        let after = t.g.snapshot();
        let (i, k) = (0..before.len())
            .flat_map(|i| (0..before.data(i).len()).map(move |k| (i, k)))
            .find(|&(i, k)| {
                let name = &before.tensors()[i].name;
                let (j, z) = (after.position(name).unwrap(), v0.position(name).unwrap());
                k % 2 == 1
                    && before.data(i)[k] == after.data(j)[k]
                    && before.data(i)[k] == v0.data(z)[k]
            })
            .expect("an unchanged element");
        // The same byte in the snapshot file (the anchor's, in the overlay
        // mode).
        let f = t.snapshot_file();
        let file = TensorSet::map(&f, false, Digests::Skip).unwrap();
        let at = data_start(&f)
            + file.tensors()[file.position(&before.tensors()[i].name).unwrap()]
                .range
                .start as u64
            + k as u64;
        drop(file);
        t.publisher = None;
        flip(&f, at);
        forge_publisher_stamps(&t.state);
        assert_eq!(
            t.reopen().await,
            Some((Check::Stamps, mode)),
            "{mode:?}: the forged stamp is trusted"
        );
        t.publish(&next).await; // v2, made from the altered bytes

        // The subscriber refuses v2 and keeps serving v1, exactly.
        let c = catch_up(&store, &sub).await.unwrap().unwrap();
        assert_eq!(c.version, 1, "{mode:?}: {c:?}");
        assert_eq!(c.quarantined.first().map(|q| q.version), Some(2), "{c:?}");
        assert_matches(&sub, &t.published[1]);

        // `weightcast verify --state` finds it; the next version is an anchor.
        t.publisher = None;
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_weightcast"))
            .args(["verify", "--state"])
            .arg(&t.state)
            .env("RUST_LOG", "error")
            .output()
            .unwrap();
        assert!(!out.status.success(), "{mode:?}: verify must fail");
        let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(report["state"]["ok"], false, "{report}");
        assert_eq!(t.reopen().await, None, "{mode:?}: distrusted");
        let out = t.step().await; // v3
        assert_eq!(out.kind, weightcast::protocol::VersionKind::Anchor);
        let c = catch_up(&store, &sub).await.unwrap().unwrap();
        assert_eq!(c.version, 3, "{mode:?}: {c:?}");
        assert_matches(&sub, &t.published[3]);
    }
}

/// A `subscribe --once` run trusts its current slot by the stamps recorded
/// when it was written (before issue 27 it read the whole slot every run):
/// content changed under a forged stamp goes unseen by the start, and
/// `weightcast verify --out` is the full check that finds it; the next run
/// then serves a verified copy. A stamp that differs is a full check.
#[tokio::test]
async fn a_once_run_trusts_its_output_by_stamps_and_verify_reads_everything() {
    let (store, _bucket) = common::local_store();
    let work = tempfile::tempdir().unwrap();
    let mut t = Trainer::new(&store, work.path(), StateMode::Auto).await;
    t.step().await;
    t.step().await;
    let out = work.path().join("sub");
    let c = catch_up(&store, &out).await.unwrap().unwrap();
    assert_eq!(c.version, 1);

    let f = out.join("current/model.safetensors");
    let at = std::fs::metadata(&f).unwrap().len() - 1;
    flip(&f, at);
    forge_output_stamps(&out);
    let c = catch_up(&store, &out).await.unwrap().unwrap();
    assert_eq!(
        (c.version, c.repairs, c.from_anchor),
        (1, 0, false),
        "trusted by its stamps: {c:?}"
    );

    let run = std::process::Command::new(env!("CARGO_BIN_EXE_weightcast"))
        .args(["verify", "--out"])
        .arg(&out)
        .env("RUST_LOG", "error")
        .output()
        .unwrap();
    assert!(!run.status.success());
    let report: serde_json::Value = serde_json::from_slice(&run.stdout).unwrap();
    let current = report["out"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["current"] == true)
        .unwrap();
    assert_eq!(current["ok"], false, "{report}");
    // The next run no longer serves the damaged slot: the standby holds the
    // same version, verified (the bootstrap run filled it before the
    // damage), and becomes current.
    let damaged = std::fs::read_link(out.join("current")).unwrap();
    let c = catch_up(&store, &out).await.unwrap().unwrap();
    assert_eq!(c.version, 1, "{c:?}");
    assert_ne!(std::fs::read_link(out.join("current")).unwrap(), damaged);
    assert_matches(&out, &t.published[1]);

    // Intact, verify says so (and changes nothing).
    let reports = DirSink::verify(&out).unwrap();
    assert!(reports.iter().all(|r| r.ok), "{reports:?}");

    // A stamp that differs (the same bytes rewritten) is a full check,
    // which passes: nothing repaired.
    let f = out.join("current/model.safetensors");
    std::fs::write(&f, std::fs::read(&f).unwrap()).unwrap();
    let c = catch_up(&store, &out).await.unwrap().unwrap();
    assert_eq!((c.version, c.repairs), (1, 0), "{c:?}");
}

/// No full clone after a bootstrap (issue 27 item 2): a `--once` bootstrap
/// fills the empty standby slot after its switch (nothing can read an empty
/// slot), so the first delta run applies its changes only. The copy falls
/// back from a reflink to a plain copy on file systems without one (this
/// test's temporary directory, ext4 or tmpfs) and is exact. A standby that
/// holds files (an engine may still read them) is left for the next run.
#[tokio::test]
async fn a_once_bootstrap_fills_the_standby_and_the_first_delta_costs_its_changes() {
    let (store, _bucket) = common::local_store();
    let work = tempfile::tempdir().unwrap();
    let mut t = Trainer::new(&store, work.path(), StateMode::Auto).await;
    t.step().await;
    let out = work.path().join("sub");
    let c = catch_up(&store, &out).await.unwrap().unwrap();
    assert!(c.from_anchor);
    let standby = c.standby.expect("the empty standby slot filled");
    assert!(standby.cloned_bytes > 0, "{standby:?}");

    t.step().await;
    let c = catch_up(&store, &out).await.unwrap().unwrap();
    assert_eq!(
        (c.version, c.deltas_applied, c.cloned_bytes, c.journal_bytes),
        (1, 1, 0, 0),
        "the first delta: its own changes only: {c:?}"
    );
    assert!(
        c.standby.is_none(),
        "the previous slot is left alone: {c:?}"
    );
    assert_matches(&out, &t.published[1]);
    let reports = DirSink::verify(&out).unwrap();
    assert!(reports.iter().all(|r| r.ok), "{reports:?}");

    t.step().await;
    let c = catch_up(&store, &out).await.unwrap().unwrap();
    assert_eq!((c.version, c.cloned_bytes), (2, 0), "{c:?}");
    assert!(
        c.journal_bytes > 0,
        "brought forward from the journal: {c:?}"
    );
    assert_matches(&out, &t.published[2]);
}

/// `compact2` across one-shot runs (issue 29): every `publish` and every
/// `--once` is a new process, and each finds the context its next delta is
/// coded against — the publisher in its state (`context/` in place and in
/// `previous` mode, the overlay's replay otherwise), the subscriber in its
/// journal — so the chain keeps its contexts without a repair. A saved context that is damaged is
/// dropped (the next delta is written without one); a subscriber that lost
/// its context repairs from the anchor. Every version bit-identical.
#[tokio::test]
async fn compact2_contexts_survive_one_shot_runs_and_their_loss_costs_no_byte() {
    for mode in [StateMode::InPlace, StateMode::Overlay, StateMode::Previous] {
        let (store, _bucket) = common::local_store();
        let work = tempfile::tempdir().unwrap();
        let mut t = Trainer::new(&store, work.path(), mode).await;
        t.encoding = Encoding::Compact2;
        let sub = work.path().join("sub");
        let follow = async |t: &Trainer, v: u64, repaired: bool| {
            let c = catch_up(&t.store, &sub).await.unwrap().unwrap();
            assert_eq!(c.version, v, "{mode:?}");
            assert_eq!(
                (c.from_anchor, c.repairs > 0),
                (v == 0 || repaired, repaired),
                "{mode:?} v{v}: {c:?}"
            );
            assert_matches(&sub, &t.published[v as usize]);
        };
        for v in 0..=2u64 {
            t.reopen().await;
            t.step().await;
            follow(&t, v, false).await;
        }
        assert!(
            !common::coded_with_context(&store, 1).await,
            "after the anchor"
        );
        assert!(common::coded_with_context(&store, 2).await, "{mode:?}");
        // A new publisher process, a new subscriber process: contexts kept.
        t.reopen().await;
        t.step().await; // v3
        assert!(
            common::coded_with_context(&store, 3).await,
            "{mode:?}: after a restart"
        );
        follow(&t, 3, false).await;

        // In place and in previous mode, the saved context damaged: dropped
        // (the files still trusted), and v4 is coded without one, still
        // exact. Over an overlay there is none to damage.
        let saved = t.state.join("context/model.safetensors.ctx");
        assert_eq!(
            saved.exists(),
            matches!(mode, StateMode::InPlace | StateMode::Previous),
            "{mode:?}"
        );
        if saved.exists() {
            let len = std::fs::metadata(&saved).unwrap().len();
            flip(&saved, len - 1);
            assert_eq!(t.reopen().await, Some((Check::Stamps, mode)));
            t.step().await; // v4
            assert!(
                !common::coded_with_context(&store, 4).await,
                "{mode:?}: a damaged context is dropped"
            );
        } else {
            t.step().await; // v4
        }
        follow(&t, 4, false).await;
        t.step().await; // v5
        assert!(common::coded_with_context(&store, 5).await, "{mode:?}");
        // The subscriber loses its journal, and with it the context of the
        // version it holds (which replaying the journal onto the standby
        // slot would make again): the next delta cannot be decoded, and it
        // repairs from the anchor.
        assert!(sub.join(format!(".journal/{:020}.ctx", 4)).exists());
        std::fs::remove_dir_all(sub.join(".journal")).unwrap();
        follow(&t, 5, true).await;
        t.step().await; // v6
        follow(&t, 6, false).await;
    }
}

/// `compact2` above `compact2_max_density`: a dense step's delta is written
/// in `compact` (no context), the next sparse one without context, the one
/// after with it; with the limit at 1 every delta after the first is coded
/// with context. The subscriber follows each bit-identically.
#[tokio::test]
async fn dense_compact2_steps_are_written_in_compact() {
    for (max, want) in [
        // The tiny trainer's steps: a few percent of the elements.
        (
            0.0,
            [Encoding::Compact, Encoding::Compact, Encoding::Compact],
        ),
        (
            1.0,
            [Encoding::Compact2, Encoding::Compact2, Encoding::Compact2],
        ),
        (
            weightcast::codec::COMPACT2_MAX_DENSITY,
            [Encoding::Compact2, Encoding::Compact2, Encoding::Compact2],
        ),
    ] {
        let (store, _bucket) = common::local_store();
        let work = tempfile::tempdir().unwrap();
        let cfg = weightcast::publisher::PublisherConfig {
            encoding: Encoding::Compact2,
            compact2_max_density: max,
            ..common::publisher_config(&work.path().join("state"), 100, None)
        };
        // A share outside 0..=1 is refused, naming the setting.
        let bad = weightcast::publisher::PublisherConfig {
            compact2_max_density: 1.5,
            ..cfg.clone()
        };
        let e = weightcast::publisher::Publisher::open(store.clone(), bad)
            .await
            .err()
            .expect("a share above 1 is refused");
        assert!(e.to_string().contains("compact2_max_density"), "{e}");
        let mut p = weightcast::publisher::Publisher::open(store.clone(), cfg)
            .await
            .unwrap();
        let mut g = common::Trainer::new(31);
        let sub = work.path().join("sub");
        for v in 0..=3u64 {
            if v > 0 {
                g.step();
            }
            p.publish(g.checkpoint(), &Default::default())
                .await
                .unwrap();
            let c = catch_up(&store, &sub).await.unwrap().unwrap();
            assert_eq!(c.version, v);
            common::assert_replica(&sub, &g.weights(), &g.config(), &format!("{max} v{v}"));
            if v > 0 {
                let h = common::delta_header(&store, v).await;
                assert_eq!(h.encoding, want[v as usize - 1], "{max} v{v}");
                // Context from the second delta on, in compact2 only.
                assert_eq!(
                    h.context.is_some(),
                    v > 1
                        && want[v as usize - 2] == Encoding::Compact2
                        && h.encoding == Encoding::Compact2,
                    "{max} v{v}"
                );
            }
        }
    }
}

/// Total bytes of the files under `dir`.
fn tree_bytes(dir: &Path) -> u64 {
    let mut n = 0;
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let m = e.metadata().unwrap();
        n += if m.is_dir() {
            tree_bytes(&e.path())
        } else {
            m.len()
        };
    }
    n
}

/// `--state-mode previous`: the publisher keeps no copy of the model — each
/// checkpoint it published (the trainer's step directory) is the next
/// delta's base, trusted by its stamps, and its state is `state.json` (plus,
/// with `compact2`, the deltas since the anchor); with `raw` anchors, only
/// until the anchor's first delta. The trainer may drop older steps. A base that is removed or rewritten (a
/// trainer writing every step into the same directory) is noticed before it
/// is read, by a running publisher and by a new process alike: the next
/// version is an anchor, and every subscriber stays exact. A checkpoint from
/// memory is refused with the setting named.
#[tokio::test]
async fn previous_mode_diffs_against_the_last_checkpoint_and_keeps_no_copy() {
    for anchors in [AnchorEncoding::Planes, AnchorEncoding::Raw] {
        previous_mode(anchors).await;
    }
}

async fn previous_mode(anchors: AnchorEncoding) {
    let (store, _bucket) = common::local_store();
    let work = tempfile::tempdir().unwrap();
    let mut t = Trainer::new(&store, work.path(), StateMode::Previous).await;
    t.anchor_encoding = anchors;
    t.reopen().await;
    let sub = work.path().join("sub");
    let kind = |p: &weightcast::publisher::Published| p.kind;
    use weightcast::protocol::VersionKind::{Anchor, Delta};

    assert_eq!(kind(&t.step().await), Anchor); // v0
    assert_eq!(
        t.state.join("snapshot/model.safetensors").exists(),
        anchors == AnchorEncoding::Raw,
        "{anchors:?}: a snapshot of its own only for raw anchors"
    );
    assert_eq!(kind(&t.step().await), Delta); // v1
    assert!(
        !t.state.join("snapshot").exists(),
        "no copy past the first delta"
    );
    let model = tree_bytes(&t.published[1]);
    for v in 2..=3 {
        assert_eq!(kind(&t.step().await), Delta, "v{v}");
        // The trainer keeps only its last checkpoint.
        std::fs::remove_dir_all(&t.published[v - 2]).unwrap();
    }
    let kept = tree_bytes(&t.state);
    assert!(
        kept < model / 4,
        "the state holds {kept} bytes for a {model}-byte model"
    );
    let state: serde_json::Value =
        serde_json::from_slice(&std::fs::read(t.state.join("state.json")).unwrap()).unwrap();
    assert_eq!(
        state["base"]["model.safetensors"]
            .as_str()
            .map(PathBuf::from),
        Some(
            t.published[3]
                .join("model.safetensors")
                .canonicalize()
                .unwrap()
        ),
        "{state}"
    );
    // A new process trusts the trainer's files by their stamps.
    assert_eq!(t.reopen().await, Some((Check::Stamps, StateMode::Previous)));
    assert_eq!(kind(&t.step().await), Delta); // v4
    let c = catch_up(&store, &sub).await.unwrap().unwrap();
    assert_eq!(c.version, 4);
    assert_matches(&sub, &t.published[4]);

    // The base removed under a running publisher: noticed before any read.
    let base = t.published[4].clone();
    let next = t.checkpoint();
    std::fs::remove_dir_all(&base).unwrap();
    let out = t.publish(&next).await; // v5
    assert_eq!(kind(&out), Anchor, "{out:?}");
    assert_eq!(kind(&t.step().await), Delta); // v6
    let c = catch_up(&store, &sub).await.unwrap().unwrap();
    assert_eq!((c.version, c.from_anchor), (6, true));
    assert_matches(&sub, &t.published[6]);

    // A trainer that writes the next step over the last one: the base is
    // gone (the new content is in its place), for a running publisher and
    // for a new process alike; each such version is an anchor, exact.
    for restart in [false, true] {
        // A delta first: its checkpoint is the base (after a raw anchor,
        // the base is the anchor's own files).
        assert_eq!(kind(&t.step().await), Delta);
        let dir = t.published.last().unwrap().clone();
        t.g.step();
        let mut f = std::fs::File::create(dir.join("model.safetensors")).unwrap();
        t.g.snapshot().write_to(&BTreeMap::new(), &mut f).unwrap();
        drop(f);
        if restart {
            assert_eq!(t.reopen().await, None, "the rewritten base is not trusted");
        }
        let out = t.publish(&dir).await;
        assert_eq!(kind(&out), Anchor, "restart {restart}: {out:?}");
        let c = catch_up(&store, &sub).await.unwrap().unwrap();
        assert_eq!(c.version, out.version);
        assert_matches(&sub, &dir);
    }

    // Another mode cannot take over the trainer's files (in place would
    // patch them): it starts from an anchor of its own, exact.
    assert_eq!(kind(&t.step().await), Delta);
    t.mode = StateMode::Overlay;
    assert_eq!(
        t.reopen().await,
        None,
        "the trainer's files are not a snapshot"
    );
    let out = t.step().await;
    assert_eq!(kind(&out), Anchor);
    assert!(t.state.join("snapshot/model.safetensors").exists());
    let c = catch_up(&store, &sub).await.unwrap().unwrap();
    assert_eq!(c.version, out.version);
    assert_matches(&sub, t.published.last().unwrap());
    t.mode = StateMode::Previous;
    t.reopen().await;

    // Nothing but files on disk can be the next base.
    let p = t.publisher.as_mut().unwrap();
    let set = TensorSet::read(
        &t.published.last().unwrap().join("model.safetensors"),
        Digests::Skip,
    )
    .unwrap();
    let cp = weightcast::publisher::Checkpoint::from_sets(
        [("model.safetensors".to_string(), set)].into(),
        BTreeMap::new(),
    )
    .unwrap();
    let e = p.publish(cp, &Default::default()).await.unwrap_err();
    assert!(e.to_string().contains("--state-mode previous"), "{e}");
}
