//! Retention on a real store: old versions and orphaned objects go, the kept
//! range still replays, and subscribers behind it re-bootstrap.

use crate::common;

use std::collections::BTreeMap;

use bytes::Bytes;
use weightcast::generator::{Generator, GeneratorConfig};
use weightcast::protocol::{ObjectRole, Retention, Staging, collect_garbage, versions_after};
use weightcast::publisher::Publisher;
use weightcast::store::Store;
use weightcast::subscriber::catch_up;

fn keep(keep_anchors: usize) -> Retention {
    Retention {
        keep_anchors,
        registration_max_age_s: Some(3600),
    }
}

async fn gc_suite(store: Store) {
    let work = tempfile::tempdir().unwrap();
    let cfg = common::publisher_config(&work.path().join("state"), 4, None);
    let mut p = Publisher::open(store.clone(), cfg).await.unwrap();
    let mut g = Generator::new(GeneratorConfig::tiny(2));
    let sub = work.path().join("sub");
    for v in 0..10u64 {
        if v > 0 {
            g.step();
        }
        let dir = work.path().join(format!("ckpt-{v}"));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("model.safetensors");
        let mut file = std::fs::File::create(&f).unwrap();
        g.snapshot().write_to(&BTreeMap::new(), &mut file).unwrap();
        p.publish_path(&f, &Default::default()).await.unwrap();
        if v == 1 {
            // A subscriber that will fall behind the retained range.
            catch_up(&store, &sub).await.unwrap().unwrap();
        }
    }
    // A losing writer's upload for a committed version, and an upload in
    // flight for the next version.
    let loser = Staging::new(9)
        .upload(
            &store,
            "x.safetensors",
            ObjectRole::Delta,
            Bytes::from_static(b"lost"),
        )
        .await
        .unwrap()
        .clone();
    let in_flight = Staging::new(10)
        .upload(
            &store,
            "x.safetensors",
            ObjectRole::Delta,
            Bytes::from_static(b"soon"),
        )
        .await
        .unwrap()
        .clone();

    // Anchors at 0, 4, 8. Keeping two keeps 4..=9.
    let dry = collect_garbage(&store, &keep(2), true).await.unwrap();
    assert_eq!(dry.keep_from, Some(4));
    assert_eq!(dry.versions, vec![0, 1, 2, 3]);
    assert_eq!(
        versions_after(&store, None).await.unwrap().len(),
        10,
        "dry run deleted something"
    );
    let done = collect_garbage(&store, &keep(2), false).await.unwrap();
    assert_eq!(done, dry);
    assert!(done.objects >= 5, "{done:?}");
    assert_eq!(
        versions_after(&store, None).await.unwrap(),
        (4..10).collect::<Vec<_>>()
    );
    assert!(
        store.get(&loser.key).await.unwrap().is_none(),
        "orphan kept"
    );
    assert!(
        store.get(&in_flight.key).await.unwrap().is_some(),
        "in-flight upload removed"
    );

    // The behind subscriber re-bootstraps from a kept anchor; a new one too.
    let c = catch_up(&store, &sub).await.unwrap().unwrap();
    assert_eq!((c.version, c.from_anchor), (9, true));
    let fresh = work.path().join("fresh");
    let c = catch_up(&store, &fresh).await.unwrap().unwrap();
    assert_eq!(c.version, 9);

    // Idempotent.
    let again = collect_garbage(&store, &keep(2), false).await.unwrap();
    assert!(again.versions.is_empty() && again.objects == 0, "{again:?}");
    assert!(collect_garbage(&store, &keep(0), true).await.is_err());
}

#[tokio::test]
async fn gc_on_local_filesystem() {
    let (store, _dir) = common::local_store();
    gc_suite(store).await;
}

#[tokio::test]
async fn gc_on_s3_moto() {
    let store = common::moto_store("gc-test", "run").await;
    gc_suite(store).await;
}

/// Writes the generator's current state as a one-file checkpoint.
fn checkpoint(g: &Generator, dir: &std::path::Path, v: u64) -> std::path::PathBuf {
    let dir = dir.join(format!("ckpt-{v}"));
    std::fs::create_dir_all(&dir).unwrap();
    let f = dir.join("model.safetensors");
    let mut file = std::fs::File::create(&f).unwrap();
    g.snapshot().write_to(&BTreeMap::new(), &mut file).unwrap();
    f
}

fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

/// Automatic retention keeps the deltas a fresh registered subscriber behind
/// the kept anchor still replays, and that subscriber then replays across the
/// anchors (through their bridge deltas) instead of downloading one; a stale
/// registration pins nothing.
async fn registered_lag_suite(store: Store) {
    let work = tempfile::tempdir().unwrap();
    let mut cfg = common::publisher_config(&work.path().join("state"), 3, None);
    cfg.retention = Some(Retention {
        keep_anchors: 1,
        registration_max_age_s: Some(3600),
    });
    let mut p = Publisher::open(store.clone(), cfg).await.unwrap();
    let mut g = Generator::new(GeneratorConfig::tiny(7));
    let lagging = work.path().join("lagging");
    let mut anchor_bytes = 0;
    for v in 0..8u64 {
        if v > 0 {
            g.step();
        }
        let out = p
            .publish_path(&checkpoint(&g, work.path(), v), &Default::default())
            .await
            .unwrap();
        if v % 3 == 0 {
            assert_eq!(out.kind, weightcast::protocol::VersionKind::Anchor);
            // Every anchor after the first carries bridges from the version before.
            assert_eq!(out.bridge_bytes > 0, v > 0, "v{v}: {out:?}");
            anchor_bytes = out.bytes - out.bridge_bytes;
        }
        if v == 1 {
            let c = catch_up(&store, &lagging).await.unwrap().unwrap();
            assert_eq!(c.version, 1);
            for (id, updated_at) in [("lagging", now()), ("gone", 0)] {
                weightcast::protocol::register(
                    &store,
                    &weightcast::protocol::Registration {
                        id: id.into(),
                        notify_url: None,
                        version: Some(1),
                        quarantined: Vec::new(),
                        updated_at,
                    },
                )
                .await
                .unwrap();
            }
        }
    }
    // Anchors at 0, 3, 6; keeping one anchor alone would keep 6..=7, but the
    // fresh registration at version 1 keeps 2..=7.
    assert_eq!(
        versions_after(&store, None).await.unwrap(),
        (2..8).collect::<Vec<_>>()
    );
    let dry = collect_garbage(&store, &keep(1), true).await.unwrap();
    assert_eq!(dry.keep_from, Some(2));
    assert_eq!(dry.kept_for, BTreeMap::from([("lagging".to_string(), 1)]));

    // The lagging subscriber replays six deltas across two anchors, for less
    // than one anchor, and ends bit-identical to a fresh bootstrap.
    let c = catch_up(&store, &lagging).await.unwrap().unwrap();
    assert_eq!((c.version, c.from_anchor, c.deltas_applied), (7, false, 6));
    assert!(
        c.downloaded < anchor_bytes,
        "{c:?} vs anchor {anchor_bytes}"
    );
    let fresh = work.path().join("fresh");
    let f = catch_up(&store, &fresh).await.unwrap().unwrap();
    assert!(f.from_anchor);
    let a = std::fs::read(lagging.join("current/model.safetensors"));
    let b = std::fs::read(fresh.join("current/model.safetensors"));
    assert!(
        a.is_ok() && a.as_ref().ok() == b.as_ref().ok(),
        "outputs differ"
    );

    // Without registrations, only the anchor range stays.
    let plain = Retention {
        keep_anchors: 1,
        registration_max_age_s: None,
    };
    let done = collect_garbage(&store, &plain, false).await.unwrap();
    assert_eq!(done.keep_from, Some(6));
    assert_eq!(done.versions, (2..6).collect::<Vec<_>>());
}

#[tokio::test]
async fn registered_lagging_subscriber_on_local_filesystem() {
    let (store, _dir) = common::local_store();
    registered_lag_suite(store).await;
}

#[tokio::test]
async fn registered_lagging_subscriber_on_s3_moto() {
    let store = common::moto_store("gc-lag", "run").await;
    registered_lag_suite(store).await;
}
