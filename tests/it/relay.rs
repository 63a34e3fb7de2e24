//! The relay: a published run mirrored into a second bucket (file → file,
//! S3 on moto → file, and a chain of two relays), a subscriber of the mirror
//! bit-identical at the last version and catching up after more versions;
//! a corrupt origin object refused (nothing committed) until the origin's
//! next anchor; a relay killed before a commit resumes without recopying
//! (through the real binary); retention at the destination only.

use crate::common;

use std::path::Path;
use std::process::Command;

use weightcast::error::ErrorKind;
use weightcast::protocol::{
    Manifest, ObjectRole, Retention, newest_version, read_manifest, versions_after,
};
use weightcast::publisher::{PublishOptions, Publisher};
use weightcast::relay::{Relay, RelayConfig};
use weightcast::store::Store;

/// A trainer publishing into `store`, an anchor every `anchor_every` versions.
struct Run {
    trainer: common::Trainer,
    publisher: Publisher,
    _state: tempfile::TempDir,
}

impl Run {
    async fn start(store: &Store, anchor_every: u64) -> Run {
        let state = tempfile::tempdir().unwrap();
        let publisher = Publisher::open(
            store.clone(),
            common::publisher_config(state.path(), anchor_every, None),
        )
        .await
        .unwrap();
        Run {
            trainer: common::Trainer::new(11),
            publisher,
            _state: state,
        }
    }

    /// Publishes `n` more versions (a training step before each but the first).
    async fn publish(&mut self, n: usize) -> u64 {
        let mut last = 0;
        for _ in 0..n {
            if self.publisher.version().is_some() {
                self.trainer.step();
            }
            last = self
                .publisher
                .publish(self.trainer.checkpoint(), &PublishOptions::default())
                .await
                .unwrap()
                .version;
        }
        last
    }

    /// Asserts that a subscriber of `store` into `out` reaches `version` and
    /// holds exactly the trainer's current weights and config.
    async fn assert_followed(&self, store: &Store, out: &Path, version: u64, what: &str) {
        let caught = weightcast::subscriber::catch_up(store, out)
            .await
            .unwrap_or_else(|e| panic!("{what}: catch-up: {e}"))
            .expect("a version");
        assert_eq!(caught.version, version, "{what}");
        common::assert_replica(out, &self.trainer.weights(), &self.trainer.config(), what);
    }
}

async fn manifest(store: &Store, v: u64) -> Manifest {
    read_manifest(store, v).await.unwrap().expect("committed")
}

fn relay(from: &Store, to: &Store) -> Relay {
    Relay::new(from.clone(), to.clone(), RelayConfig::default())
}

/// Publishes 5 versions (anchors at 0 and 3), relays once, follows the
/// mirror; then 3 more versions (anchor at 6), relays, follows again.
async fn mirror_and_follow(origin: &Store, dest: &Store) {
    let mut run = Run::start(origin, 3).await;
    let out = tempfile::tempdir().unwrap();
    assert_eq!(run.publish(5).await, 4);
    let mut r = relay(origin, dest);
    let rep = r.sync_once().await.unwrap();
    // An empty destination starts at the origin's newest anchor, not at 0.
    assert_eq!(rep.versions, vec![3, 4], "{rep:?}");
    assert_eq!((rep.origin, rep.destination), (Some(4), Some(4)));
    let mut objects = 0;
    let mut bytes = 0;
    for v in [3, 4] {
        let m = manifest(origin, v).await;
        assert_eq!(manifest(dest, v).await, m, "v{v} manifest copied as is");
        objects += m.objects.len() as u64;
        bytes += m.objects.iter().map(|o| o.size).sum::<u64>();
    }
    assert_eq!((rep.objects, rep.bytes, rep.skipped), (objects, bytes, 0));
    assert_eq!(versions_after(dest, None).await.unwrap(), vec![3, 4]);
    run.assert_followed(dest, out.path(), 4, "mirror at v4")
        .await;

    // Nothing new: nothing copied.
    let idle = r.sync_once().await.unwrap();
    assert!(idle.versions.is_empty() && idle.objects == 0, "{idle:?}");

    assert_eq!(run.publish(3).await, 7);
    let rep = r.sync_once().await.unwrap();
    assert_eq!(rep.versions, vec![5, 6, 7], "{rep:?}");
    assert_eq!(rep.skipped, 0);
    run.assert_followed(dest, out.path(), 7, "mirror at v7")
        .await;
    let latest = weightcast::protocol::read_latest(dest, None)
        .await
        .unwrap()
        .unwrap()
        .0;
    assert_eq!((latest.version, latest.anchor_version), (7, 6));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_to_file_mirror_is_followed_bit_identically() {
    let (origin, _o) = common::local_store();
    let (dest, _d) = common::local_store();
    mirror_and_follow(&origin, &dest).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_to_file_mirror_is_followed_bit_identically() {
    let origin = common::moto_store("relay-origin", "policy").await;
    let (dest, _d) = common::local_store();
    mirror_and_follow(&origin, &dest).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chain_of_two_relays_reaches_the_zone() {
    let (origin, _o) = common::local_store();
    let (region, _r) = common::local_store();
    let (zone, _z) = common::local_store();
    let mut run = Run::start(&origin, 4).await;
    let out = tempfile::tempdir().unwrap();
    let (mut hop1, mut hop2) = (relay(&origin, &region), relay(&region, &zone));
    run.publish(2).await;
    assert_eq!(hop1.sync_once().await.unwrap().versions, vec![0, 1]);
    assert_eq!(hop2.sync_once().await.unwrap().versions, vec![0, 1]);
    run.assert_followed(&zone, out.path(), 1, "zone at v1")
        .await;
    run.publish(4).await;
    let a = hop1.sync_once().await.unwrap();
    let b = hop2.sync_once().await.unwrap();
    assert_eq!(a.versions, vec![2, 3, 4, 5]);
    // The zone's hop moves exactly what the region's hop moved.
    assert_eq!(
        (b.versions, b.objects, b.bytes),
        (a.versions, a.objects, a.bytes)
    );
    run.assert_followed(&zone, out.path(), 5, "zone at v5")
        .await;
}

/// Flips one byte of `key` in a local store rooted at `dir`.
fn flip_byte(dir: &Path, key: &str) {
    let path = dir.join(key);
    let mut bytes = std::fs::read(&path).unwrap();
    let at = bytes.len() / 2;
    bytes[at] ^= 0x40;
    std::fs::write(&path, bytes).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_origin_object_is_never_relayed() {
    let (origin, odir) = common::local_store();
    let (dest, ddir) = common::local_store();
    let mut run = Run::start(&origin, 3).await;
    let out = tempfile::tempdir().unwrap();
    run.publish(2).await;
    let mut r = relay(&origin, &dest);
    assert_eq!(r.sync_once().await.unwrap().versions, vec![0, 1]);

    assert_eq!(run.publish(1).await, 2);
    let m2 = manifest(&origin, 2).await;
    let victim = m2
        .objects
        .iter()
        .find(|o| o.name == "model.safetensors")
        .expect("a delta object")
        .key
        .clone();
    flip_byte(odir.path(), &victim);
    for _ in 0..2 {
        let e = r.sync_once().await.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Corrupt, "{e}");
        assert!(e.to_string().contains(&victim), "names the object: {e}");
        assert_eq!(newest_version(&dest).await.unwrap(), Some(1));
        assert!(read_manifest(&dest, 2).await.unwrap().is_none());
        assert!(
            !ddir.path().join(&victim).exists(),
            "the corrupt object was written at the destination"
        );
    }
    // The mirror still serves v1.
    weightcast::subscriber::catch_up(&dest, out.path())
        .await
        .unwrap();

    // The origin's next anchor (v3) lets the region move past v2.
    assert_eq!(run.publish(1).await, 3);
    let rep = r.sync_once().await.unwrap();
    assert_eq!((rep.versions, rep.bypassed), (vec![3], vec![2]));
    assert!(read_manifest(&dest, 2).await.unwrap().is_none());
    run.assert_followed(&dest, out.path(), 3, "mirror past the corrupt version")
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(feature = "failpoints"),
    ignore = "needs --features failpoints (scripts/test.sh enables it)"
)]
async fn a_relay_killed_before_a_commit_resumes_without_recopying() {
    let (origin, _o) = common::local_store();
    let (dest, _d) = common::local_store();
    let mut run = Run::start(&origin, 10).await;
    run.publish(3).await;
    let relay_once = |failpoint: Option<&str>| {
        let mut c = Command::new(env!("CARGO_BIN_EXE_weightcast"));
        c.args([
            "relay",
            "--once",
            "--from",
            origin.url(),
            "--to",
            dest.url(),
        ])
        .env_remove("WEIGHTCAST_FAILPOINT");
        if let Some(f) = failpoint {
            c.env("WEIGHTCAST_FAILPOINT", f);
        }
        c.output().expect("running weightcast relay")
    };
    let crashed = relay_once(Some("relay.before_commit"));
    assert!(!crashed.status.success(), "the failpoint aborts");
    // Every object of v0 is there, but v0 is not committed.
    let m0 = manifest(&origin, 0).await;
    for o in &m0.objects {
        assert!(
            dest.head(&o.key).await.unwrap().is_some(),
            "{} copied",
            o.key
        );
    }
    assert_eq!(newest_version(&dest).await.unwrap(), None);

    let done = relay_once(None);
    assert!(
        done.status.success(),
        "{}",
        String::from_utf8_lossy(&done.stderr)
    );
    let rep: serde_json::Value =
        serde_json::from_slice(done.stdout.trim_ascii()).expect("one JSON line");
    assert_eq!(rep["versions"], serde_json::json!([0, 1, 2]), "{rep}");
    let (n0, b0) = (
        m0.objects.len() as u64,
        m0.objects.iter().map(|o| o.size).sum::<u64>(),
    );
    assert_eq!(rep["skipped"].as_u64(), Some(n0), "{rep}");
    assert_eq!(rep["bytes_skipped"].as_u64(), Some(b0), "{rep}");
    let mut rest = 0;
    for v in [1, 2] {
        rest += manifest(&origin, v).await.objects.len() as u64;
    }
    assert_eq!(rep["objects"].as_u64(), Some(rest), "{rep}");
    let out = tempfile::tempdir().unwrap();
    run.assert_followed(&dest, out.path(), 2, "after the resumed relay")
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_applies_at_the_destination_only() {
    let (origin, _o) = common::local_store();
    let (dest, _d) = common::local_store();
    let mut run = Run::start(&origin, 2).await;
    let cfg = RelayConfig {
        retention: Some(Retention {
            keep_anchors: 1,
            registration_max_age_s: None,
        }),
        ..RelayConfig::default()
    };
    let mut r = Relay::new(origin.clone(), dest.clone(), cfg);
    for _ in 0..5 {
        run.publish(1).await;
        r.sync_once().await.unwrap();
    }
    // Anchors at 0, 2, 4: the destination keeps the newest one and after.
    assert_eq!(versions_after(&dest, None).await.unwrap(), vec![4]);
    assert_eq!(
        versions_after(&origin, None).await.unwrap(),
        vec![0, 1, 2, 3, 4]
    );
    let keys = |s: Store| async move {
        s.list("anchors")
            .await
            .unwrap()
            .into_iter()
            .map(|l| l.key)
            .collect::<Vec<_>>()
    };
    let anchors = keys(dest.clone()).await;
    assert!(
        anchors
            .iter()
            .all(|k| k.starts_with("anchors/00000000000000000004-")),
        "{anchors:?}"
    );
    assert_eq!(keys(origin.clone()).await.len(), 3, "origin untouched");
    let out = tempfile::tempdir().unwrap();
    run.assert_followed(&dest, out.path(), 4, "after retention")
        .await;
}

const SECRET: &str = "a-relay-test-secret-of-length";

/// The daemon: a wake-up (what the origin publisher's notification does on
/// `--listen`) makes it sync, and its notification makes the region's
/// subscriber catch up; both poll hourly, so nothing else could.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_daemon_relays_on_wake_up_and_notifies_the_region() {
    use std::sync::Arc;
    use std::time::{Duration, Instant};
    use weightcast::notify::Key;
    use weightcast::subscriber::status::Shared;
    use weightcast::subscriber::{DaemonConfig, run};

    let (origin, _o) = common::local_store();
    let (dest, _d) = common::local_store();
    let mut trainer_run = Run::start(&origin, 10).await;
    trainer_run.publish(2).await;

    // The region's subscriber, listening for notifications.
    let out = tempfile::tempdir().unwrap();
    let shared = Shared::new(dest.url(), Some(Key::new(SECRET).unwrap()));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let notify_url = format!("http://{}/v1/notify", listener.local_addr().unwrap());
    tokio::spawn(weightcast::http::subscriber::serve(
        listener,
        shared.clone(),
        std::future::pending(),
    ));
    let cfg = DaemonConfig {
        poll_interval: Duration::from_secs(3600),
        hooks: Vec::new(),
        ..DaemonConfig::new(out.path())
    };
    let (st, sh) = (dest.clone(), shared.clone());
    tokio::spawn(async move { run(&st, &cfg, &sh, std::future::pending()).await });

    let relay_cfg = RelayConfig {
        interval: Duration::from_secs(3600),
        notify_urls: vec![notify_url],
        notify_key: Some(Key::new(SECRET).unwrap()),
        ..RelayConfig::default()
    };
    let wake = Arc::new(tokio::sync::Notify::new());
    let synced = Arc::new(std::sync::Mutex::new(Vec::new()));
    let (w, s) = (wake.clone(), synced.clone());
    let relay = Relay::new(origin.clone(), dest.clone(), relay_cfg);
    tokio::spawn(async move {
        relay
            .run(
                &w,
                |r| {
                    s.lock()
                        .unwrap()
                        .push(r.as_ref().map(|r| r.versions.clone()).ok())
                },
                std::future::pending(),
            )
            .await
    });
    let wait = |v: u64| {
        let shared = shared.clone();
        async move {
            let deadline = Instant::now() + Duration::from_secs(30);
            while shared.status.lock().unwrap().version != Some(v) {
                assert!(
                    Instant::now() < deadline,
                    "the subscriber did not reach v{v}"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };
    // The first sync runs at start.
    wait(1).await;
    trainer_run.publish(2).await;
    wake.notify_one();
    wait(3).await;
    common::assert_replica(
        out.path(),
        &trainer_run.trainer.weights(),
        &trainer_run.trainer.config(),
        "the region's subscriber after the daemon's relay",
    );
    assert_eq!(
        *synced.lock().unwrap(),
        vec![Some(vec![0, 1]), Some(vec![2, 3])]
    );
}

/// `weightcast relay --from-option/--to-option`: each side takes its own
/// endpoint and credentials over the environment's. The origin is moto
/// reached directly with one access key, the destination moto reached
/// through a counting proxy (a second endpoint) with another; the
/// environment's endpoint leads nowhere. Every request the proxy sees is
/// the destination's, and the mirror is followed bit-identically. A
/// malformed option, an unknown key and an option given to a `file://`
/// store are refused by name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_cli_takes_options_per_side() {
    let origin = common::moto_store("relay-opt-origin", "policy").await;
    common::moto_bucket("relay-opt-dest").await;
    let proxy = crate::faultproxy::FaultProxy::start(common::moto().port).await;
    let side = |endpoint: String, key: &str| {
        vec![
            format!("aws_endpoint={endpoint}"),
            "aws_allow_http=true".to_string(),
            format!("aws_access_key_id={key}"),
            "aws_secret_access_key=test".to_string(),
            "aws_region=us-east-1".to_string(),
        ]
    };
    let from_opts = side(
        format!("http://127.0.0.1:{}", common::moto().port),
        "origin-key",
    );
    let to_opts = side(format!("http://127.0.0.1:{}", proxy.port), "dest-key");
    let mut run = Run::start(&origin, 10).await;
    assert_eq!(run.publish(3).await, 2);

    let relay = |from_opts: &[String], to: &str, to_opts: &[String]| {
        let mut c = Command::new(env!("CARGO_BIN_EXE_weightcast"));
        c.args([
            "relay",
            "--once",
            "--from",
            "s3://relay-opt-origin/policy",
            "--to",
            to,
        ])
        .env("AWS_ENDPOINT", "http://127.0.0.1:9")
        .env("AWS_ACCESS_KEY_ID", "env-key")
        .env("AWS_SECRET_ACCESS_KEY", "env-secret")
        .env_remove("WEIGHTCAST_FAILPOINT");
        for o in from_opts {
            c.args(["--from-option", o]);
        }
        for o in to_opts {
            c.args(["--to-option", o]);
        }
        c.output().expect("running weightcast relay")
    };
    let out = relay(&from_opts, "s3://relay-opt-dest/policy", &to_opts);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rep: serde_json::Value =
        serde_json::from_slice(out.stdout.trim_ascii()).expect("one JSON line");
    assert_eq!(rep["versions"], serde_json::json!([0, 1, 2]), "{rep}");
    let seen = proxy.seen();
    assert!(
        seen.iter().any(|s| s.method == axum::http::Method::PUT),
        "the destination was written through its own endpoint"
    );
    let clients: std::collections::BTreeSet<_> = seen.iter().map(|s| s.client.clone()).collect();
    assert_eq!(
        clients,
        [Some("dest-key".to_string())].into(),
        "only the destination's requests, signed with its key, went to its endpoint"
    );
    let o: Vec<(String, String)> = common::moto_options();
    let o: Vec<(&str, &str)> = o.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let dest = Store::open_with("s3://relay-opt-dest/policy", &o).unwrap();
    let followed = tempfile::tempdir().unwrap();
    run.assert_followed(&dest, followed.path(), 2, "mirror on the second endpoint")
        .await;

    // Refused by name, before anything is copied.
    let (file_dest, _d) = common::local_store();
    for (to, to_opts, needle) in [
        (
            "s3://relay-opt-dest/policy",
            vec!["aws_endpoint".to_string()],
            "KEY=VALUE",
        ),
        (
            "s3://relay-opt-dest/policy",
            vec!["aws_endpoit=x".to_string()],
            "aws_endpoit",
        ),
        (
            file_dest.url(),
            vec!["aws_region=x".to_string()],
            "takes no options",
        ),
    ] {
        let out = relay(&from_opts, to, &to_opts);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains(needle),
            "{needle}: {err}"
        );
    }
    assert_eq!(newest_version(&file_dest).await.unwrap(), None);
}

/// Empties a local bucket (the origin wiped).
fn wipe(dir: &Path) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            std::fs::remove_dir_all(p).unwrap();
        } else {
            std::fs::remove_file(p).unwrap();
        }
    }
}

/// `weightcast relay --once` from `from` to `to`.
fn relay_once_cli(from: &Store, to: &Store) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_weightcast"))
        .args(["relay", "--once", "--from", from.url(), "--to", to.url()])
        .env_remove("WEIGHTCAST_FAILPOINT")
        .env_remove("RUST_LOG")
        .output()
        .expect("running weightcast relay")
}

/// A sync's report as JSON (what `relay --once` prints).
fn json(rep: &weightcast::relay::RelayReport) -> serde_json::Value {
    serde_json::to_value(rep).unwrap()
}

/// Issue 30, defect 1: an origin wiped and published again from a fresh
/// state numbers its versions from 0 again. `relay --once` used to exit 0
/// copying the new v5 (a delta on the *new* v4) onto the old v0–4, and every
/// subscriber quarantined it ("wrong base"). The relay follows one lineage:
/// it refuses, naming both manifests, while the origin has no anchor after
/// the destination's newest version, then starts the new lineage at that
/// anchor and says so; the region's follower and a fresh subscriber are
/// exact at every point.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_origin_reset_to_the_same_versions_is_never_joined() {
    let (origin, odir) = common::local_store();
    let (dest, _d) = common::local_store();
    let follower = tempfile::tempdir().unwrap();
    let mut old = Run::start(&origin, 3).await;
    assert_eq!(old.publish(5).await, 4);
    let mut r = relay(&origin, &dest);
    assert_eq!(r.sync_once().await.unwrap().versions, vec![3, 4]);
    old.assert_followed(&dest, follower.path(), 4, "the old history")
        .await;
    let mirrored = manifest(&dest, 4).await;

    wipe(odir.path());
    let mut new = Run::start(&origin, 3).await;
    new.trainer = common::Trainer::new(12);
    assert_eq!(new.publish(6).await, 5);
    let reset = manifest(&origin, 4).await;
    assert_ne!(reset.writer, mirrored.writer);

    let out = relay_once_cli(&origin, &dest);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(75),
        "refused, retry later: {stderr}"
    );
    for needle in [
        "versions/00000000000000000004.json",
        reset.writer.as_str(),
        mirrored.writer.as_str(),
        "empty prefix",
    ] {
        assert!(stderr.contains(needle), "names {needle}: {stderr}");
    }
    let e = r.sync_once().await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Precondition, "{e}");
    assert_eq!(newest_version(&dest).await.unwrap(), Some(4));
    old.assert_followed(&dest, follower.path(), 4, "still the old history")
        .await;

    // The origin's next anchor (v6) is numbered after everything the
    // destination holds: the new lineage starts there.
    assert_eq!(new.publish(1).await, 6);
    let rep = r.sync_once().await.unwrap();
    assert_eq!(rep.versions, vec![6], "{rep:?}");
    let lineage = &json(&rep)["new_lineage"];
    assert_eq!(
        (&lineage["anchor"], &lineage["after"]),
        (&6.into(), &4.into()),
        "{rep:?}"
    );
    assert!(newest_version(&dest).await.unwrap() == Some(6));
    assert!(read_manifest(&dest, 5).await.unwrap().is_none());
    new.assert_followed(
        &dest,
        follower.path(),
        6,
        "the follower, on the new lineage",
    )
    .await;
    let fresh = tempfile::tempdir().unwrap();
    new.assert_followed(&dest, fresh.path(), 6, "a fresh subscriber")
        .await;
    assert_eq!(new.publish(1).await, 7);
    let rep = r.sync_once().await.unwrap();
    assert_eq!(rep.versions, vec![7]);
    assert!(json(&rep).get("new_lineage").is_none(), "{rep:?}");
    new.assert_followed(&dest, follower.path(), 7, "the follower after")
        .await;
}

/// The lineage check attacked with an origin reset that went *past* the
/// destination's numbers while the relay was away: the new history's v5 is
/// a delta on its own v4 and is never copied; the relay restarts at the
/// origin's newest anchor (v6) and goes on from there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_origin_reset_past_the_destination_restarts_at_its_anchor() {
    let (origin, odir) = common::local_store();
    let (dest, _d) = common::local_store();
    let follower = tempfile::tempdir().unwrap();
    let mut old = Run::start(&origin, 3).await;
    old.publish(5).await;
    let mut r = relay(&origin, &dest);
    r.sync_once().await.unwrap();
    old.assert_followed(&dest, follower.path(), 4, "the old history")
        .await;
    wipe(odir.path());
    let mut new = Run::start(&origin, 3).await;
    new.trainer = common::Trainer::new(13);
    assert_eq!(new.publish(8).await, 7);
    let rep = r.sync_once().await.unwrap();
    assert_eq!(rep.versions, vec![6, 7], "{rep:?}");
    let lineage = &json(&rep)["new_lineage"];
    assert_eq!(
        (&lineage["anchor"], &lineage["after"]),
        (&6.into(), &4.into()),
        "{rep:?}"
    );
    assert!(
        lineage["reason"].as_str().unwrap().contains("at version 4"),
        "{lineage}"
    );
    assert!(read_manifest(&dest, 5).await.unwrap().is_none());
    new.assert_followed(&dest, follower.path(), 7, "the follower")
        .await;
}

/// The lineage check attacked with a new history whose anchor is the very
/// next version, bridged on the *new* v4: its bridges would lead a follower
/// of the old v4 astray, so the anchor is copied without them (a new
/// lineage: an unbridged anchor), and the next sync continues it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_lineage_anchor_right_after_the_destination_loses_its_bridges() {
    let (origin, odir) = common::local_store();
    let (dest, _d) = common::local_store();
    let follower = tempfile::tempdir().unwrap();
    let mut old = Run::start(&origin, 5).await;
    old.publish(5).await;
    let mut r = relay(&origin, &dest);
    assert_eq!(r.sync_once().await.unwrap().versions, vec![0, 1, 2, 3, 4]);
    old.assert_followed(&dest, follower.path(), 4, "the old history")
        .await;
    wipe(odir.path());
    let mut new = Run::start(&origin, 5).await;
    new.trainer = common::Trainer::new(14);
    assert_eq!(new.publish(6).await, 5);
    let bridged = manifest(&origin, 5).await;
    assert_eq!(bridged.base_version, Some(4), "the origin's v5 is bridged");
    let rep = r.sync_once().await.unwrap();
    assert_eq!(rep.versions, vec![5], "{rep:?}");
    assert_eq!(json(&rep)["new_lineage"]["anchor"], 5, "{rep:?}");
    let copied = manifest(&dest, 5).await;
    assert_eq!(copied.base_version, None, "{copied:?}");
    assert!(copied.objects.iter().all(|o| o.role != ObjectRole::Delta));
    assert_eq!(copied.writer, bridged.writer);
    new.assert_followed(&dest, follower.path(), 5, "the follower bootstraps")
        .await;
    // Its successor's base is the destination's v5: continued.
    assert_eq!(new.publish(1).await, 6);
    let rep = r.sync_once().await.unwrap();
    assert_eq!(rep.versions, vec![6], "{rep:?}");
    assert!(json(&rep).get("new_lineage").is_none(), "{rep:?}");
    new.assert_followed(&dest, follower.path(), 6, "the follower after")
        .await;
}

/// The lineage check attacked with a foreign writer: a publisher writing
/// straight into the destination takes its next version; the origin's next
/// delta is never copied onto it, and the sync says why, naming both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_foreign_writer_in_the_destination_is_refused() {
    let (origin, _o) = common::local_store();
    let (dest, _d) = common::local_store();
    let mut run = Run::start(&origin, 10).await;
    run.publish(3).await;
    let mut r = relay(&origin, &dest);
    assert_eq!(r.sync_once().await.unwrap().versions, vec![0, 1, 2]);
    let mut foreign = Run::start(&dest, 10).await;
    foreign.trainer = common::Trainer::new(15);
    assert_eq!(foreign.publish(1).await, 3);
    let theirs = manifest(&dest, 3).await;
    assert_eq!(run.publish(2).await, 4);
    let e = r.sync_once().await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Precondition, "{e}");
    let msg = e.to_string();
    assert!(
        msg.contains(&theirs.writer) && msg.contains(&manifest(&origin, 3).await.writer),
        "{msg}"
    );
    assert_eq!(newest_version(&dest).await.unwrap(), Some(3));
    let out = tempfile::tempdir().unwrap();
    foreign
        .assert_followed(&dest, out.path(), 3, "the foreign version stands alone")
        .await;
}

/// Issue 30, the relay's smaller items: a middle manifest deleted from the
/// destination, an object truncated there, an object damaged in place
/// (reported quarantined by the region's subscriber), and staging files a
/// killed upload left: the next sync repairs each from the origin instead
/// of leaving the region to wait for the next anchor.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_damaged_destination_is_repaired_from_the_origin() {
    use weightcast::subscriber::status::Shared;
    use weightcast::subscriber::{Daemon, DaemonConfig};
    let (origin, _o) = common::local_store();
    let (dest, ddir) = common::local_store();
    let mut run = Run::start(&origin, 10).await;
    let follower = tempfile::tempdir().unwrap();
    run.publish(2).await;
    let mut r = relay(&origin, &dest);
    r.sync_once().await.unwrap();
    run.assert_followed(&dest, follower.path(), 1, "before")
        .await;
    run.publish(3).await;
    r.sync_once().await.unwrap();

    // A middle manifest deleted: the follower at v1 cannot go on.
    std::fs::remove_file(ddir.path().join("versions/00000000000000000002.json")).unwrap();
    let stuck = weightcast::subscriber::catch_up(&dest, follower.path()).await;
    assert!(
        !matches!(&stuck, Ok(Some(c)) if c.version == 4),
        "{stuck:?}"
    );
    let rep = r.sync_once().await.unwrap();
    assert_eq!(
        json(&rep)["repaired_versions"],
        serde_json::json!([2]),
        "{rep:?}"
    );
    assert!(rep.versions.is_empty());
    run.assert_followed(&dest, follower.path(), 4, "after the manifest's repair")
        .await;

    // An object truncated, another damaged in place; staging files left.
    let m3 = manifest(&dest, 3).await;
    let m4 = manifest(&dest, 4).await;
    let delta = |m: &Manifest| {
        m.objects
            .iter()
            .find(|o| o.name == "model.safetensors")
            .unwrap()
            .key
            .clone()
    };
    let (short, flipped) = (delta(&m3), delta(&m4));
    let bytes = std::fs::read(ddir.path().join(&short)).unwrap();
    std::fs::write(ddir.path().join(&short), &bytes[..bytes.len() / 2]).unwrap();
    flip_byte(ddir.path(), &flipped);
    let staging = [
        ddir.path().join(format!("{short}#1")),
        ddir.path().join("latest.json#7"),
    ];
    for s in &staging {
        std::fs::write(s, b"partial").unwrap();
    }
    // The region's subscriber (registered) quarantines v4 and says so.
    let edge = tempfile::tempdir().unwrap();
    let cfg = DaemonConfig {
        id: Some("edge-1".into()),
        ..DaemonConfig::new(edge.path())
    };
    let shared = Shared::new(dest.url(), None);
    let mut d = Daemon::open(&dest, &cfg).unwrap();
    let first = d.iterate(&shared, true).await;
    assert!(
        !matches!(&first, Ok(Some((c, _))) if c.version == 4),
        "{first:?}"
    );
    let regs = weightcast::protocol::registrations(&dest).await.unwrap();
    assert!(regs.iter().any(|g| g.quarantined.contains(&4)), "{regs:?}");

    // A new relay process: it sweeps the staging files and repairs both.
    let mut r = relay(&origin, &dest);
    let rep = r.sync_once().await.unwrap();
    let j = json(&rep);
    let mut repaired: Vec<String> = serde_json::from_value(j["repaired_objects"].clone())
        .unwrap_or_else(|e| panic!("{e}: {j}"));
    repaired.sort();
    let mut want = vec![short.clone(), flipped.clone()];
    want.sort();
    assert_eq!(repaired, want, "{j}");
    assert_eq!(j["staging_removed"], 2, "{j}");
    for s in &staging {
        assert!(!s.exists(), "{} left", s.display());
    }
    for o in m3.objects.iter().chain(&m4.objects) {
        assert_eq!(
            dest.measure(&o.key).await.unwrap(),
            Some((o.size, o.blake3.clone())),
            "{}",
            o.key
        );
    }
    let fresh = tempfile::tempdir().unwrap();
    run.assert_followed(
        &dest,
        fresh.path(),
        4,
        "a fresh subscriber after the repairs",
    )
    .await;
    // Measured once: the report still standing is not measured again.
    let again = r.sync_once().await.unwrap();
    assert!(json(&again).get("repaired_objects").is_none(), "{again:?}");
}

/// The lineage check attacked with an origin reset to *higher* numbers: the
/// bucket wiped under a publisher that keeps its state numbers its next
/// version after what it had (an unbridged anchor, v5). Copying it is safe
/// (it needs nothing before it), and the relay says that the destination's
/// history ends at v4 and a new lineage starts there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_origin_reset_to_higher_numbers_is_said_to_start_a_new_lineage() {
    let (origin, odir) = common::local_store();
    let (dest, _d) = common::local_store();
    let follower = tempfile::tempdir().unwrap();
    let mut run = Run::start(&origin, 10).await;
    run.publish(5).await;
    let mut r = relay(&origin, &dest);
    r.sync_once().await.unwrap();
    run.assert_followed(&dest, follower.path(), 4, "before the reset")
        .await;
    wipe(odir.path());
    assert_eq!(run.publish(1).await, 5);
    let m5 = manifest(&origin, 5).await;
    assert_eq!(
        (m5.kind, m5.base_version),
        (weightcast::protocol::VersionKind::Anchor, None)
    );
    let rep = r.sync_once().await.unwrap();
    assert_eq!(rep.versions, vec![5], "{rep:?}");
    let lineage = &json(&rep)["new_lineage"];
    assert_eq!(
        (&lineage["anchor"], &lineage["after"]),
        (&5.into(), &4.into()),
        "{rep:?}"
    );
    assert_eq!(manifest(&dest, 5).await, m5, "copied as it is");
    run.assert_followed(&dest, follower.path(), 5, "after the reset")
        .await;
    run.publish(1).await;
    let rep = r.sync_once().await.unwrap();
    assert_eq!(rep.versions, vec![6]);
    assert!(json(&rep).get("new_lineage").is_none(), "{rep:?}");
}
