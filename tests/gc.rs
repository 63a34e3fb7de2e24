//! Retention on a real store: old versions and orphaned objects go, the kept
//! range still replays, and subscribers behind it re-bootstrap.

mod common;

use std::collections::BTreeMap;

use bytes::Bytes;
use weightcast::generator::{Generator, GeneratorConfig};
use weightcast::protocol::{
    ObjectRole, collect_garbage, upload_object, versions_after, writer_token,
};
use weightcast::publisher::Publisher;
use weightcast::store::Store;
use weightcast::subscriber::catch_up;

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
        p.publish(&f).await.unwrap();
        if v == 1 {
            // A subscriber that will fall behind the retained range.
            catch_up(&store, &sub).await.unwrap().unwrap();
        }
    }
    // A losing writer's upload for a committed version, and an upload in
    // flight for the next version.
    let loser = upload_object(
        &store,
        9,
        &writer_token(),
        "x.safetensors",
        ObjectRole::Delta,
        Bytes::from_static(b"lost"),
    )
    .await
    .unwrap();
    let in_flight = upload_object(
        &store,
        10,
        &writer_token(),
        "x.safetensors",
        ObjectRole::Delta,
        Bytes::from_static(b"soon"),
    )
    .await
    .unwrap();

    // Anchors at 0, 4, 8. Keeping two keeps 4..=9.
    let dry = collect_garbage(&store, 2, true).await.unwrap();
    assert_eq!(dry.keep_from, Some(4));
    assert_eq!(dry.versions, vec![0, 1, 2, 3]);
    assert_eq!(
        versions_after(&store, None).await.unwrap().len(),
        10,
        "dry run deleted something"
    );
    let done = collect_garbage(&store, 2, false).await.unwrap();
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
    let again = collect_garbage(&store, 2, false).await.unwrap();
    assert!(again.versions.is_empty() && again.objects == 0, "{again:?}");
    assert!(collect_garbage(&store, 0, true).await.is_err());
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
