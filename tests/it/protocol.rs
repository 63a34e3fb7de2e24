//! The commit protocol on real stores: in-memory, local filesystem, and S3 on
//! moto (a real server on loopback).

use crate::common;

use bytes::Bytes;
use weightcast::protocol::{
    Commit, Latest, Manifest, ObjectRole, Staging, VersionKind, commit, read_latest, read_manifest,
    repair_latest, versions_after, write_latest,
};
use weightcast::store::Store;

async fn publish(store: &Store, version: u64, payload: &[u8]) -> (Manifest, Commit) {
    let (kind, role) = if version == 0 {
        (VersionKind::Anchor, ObjectRole::Anchor)
    } else {
        (VersionKind::Delta, ObjectRole::Delta)
    };
    let mut staging = Staging::new(version);
    staging
        .upload(
            store,
            "model.safetensors",
            role,
            Bytes::copy_from_slice(payload),
        )
        .await
        .unwrap();
    let cfg = staging
        .upload(
            store,
            "config.json",
            ObjectRole::File,
            Bytes::from_static(b"{}"),
        )
        .await
        .unwrap()
        .clone();
    staging.list_file(&cfg.name, cfg.size, cfg.blake3);
    let m = staging.manifest(kind, version.checked_sub(1), 0, None);
    let outcome = commit(store, &m).await.unwrap();
    (m, outcome)
}

async fn protocol_suite(store: &Store) {
    // Nothing is visible before the manifest exists, even with objects uploaded.
    Staging::new(0)
        .upload(
            store,
            "model.safetensors",
            ObjectRole::Anchor,
            Bytes::from_static(b"x"),
        )
        .await
        .unwrap();
    assert_eq!(
        versions_after(store, None).await.unwrap(),
        Vec::<u64>::new()
    );
    assert_eq!(read_manifest(store, 0).await.unwrap(), None);
    assert_eq!(read_latest(store, None).await.unwrap(), None);

    // Commit v0; it becomes visible with exactly the objects it names.
    let (m0, c0) = publish(store, 0, b"anchor-bytes").await;
    assert_eq!(c0, Commit::Committed);
    assert_eq!(versions_after(store, None).await.unwrap(), vec![0]);
    let read = read_manifest(store, 0).await.unwrap().unwrap();
    assert_eq!(read, m0);
    for o in &read.objects {
        let bytes = store.get(&o.key).await.unwrap().unwrap();
        assert_eq!(blake3::hash(&bytes).to_hex().as_str(), o.blake3);
        assert_eq!(bytes.len() as u64, o.size);
    }

    // Two publishers race for v1: exactly one commit, the winner's bytes intact.
    let (a, b) = tokio::join!(
        publish(store, 1, b"delta-from-a"),
        publish(store, 1, b"delta-from-b")
    );
    let winners: Vec<&(Manifest, Commit)> = [&a, &b]
        .into_iter()
        .filter(|x| x.1 == Commit::Committed)
        .collect();
    assert_eq!(
        winners.len(),
        1,
        "both or neither committed: {:?} {:?}",
        a.1,
        b.1
    );
    let committed = read_manifest(store, 1).await.unwrap().unwrap();
    assert_eq!(&committed, &winners[0].0);
    let body = store.get(&committed.objects[0].key).await.unwrap().unwrap();
    assert_eq!(
        blake3::hash(&body).to_hex().as_str(),
        committed.objects[0].blake3
    );

    // The hint: one small conditional read per poll.
    write_latest(
        store,
        &Latest {
            version: 1,
            anchor_version: 0,
        },
    )
    .await
    .unwrap();
    let (l, etag) = read_latest(store, None).await.unwrap().unwrap();
    assert_eq!(
        l,
        Latest {
            version: 1,
            anchor_version: 0
        }
    );
    if let Some(etag) = etag {
        assert_eq!(
            read_latest(store, Some(&etag)).await.unwrap(),
            None,
            "unchanged hint re-read"
        );
    }

    // A publisher that died between commit and hint: repair finds the truth.
    let (_, c2) = publish(store, 2, b"delta-2").await;
    assert_eq!(c2, Commit::Committed);
    assert_eq!(
        read_latest(store, None).await.unwrap().unwrap().0.version,
        1
    );
    assert_eq!(versions_after(store, Some(1)).await.unwrap(), vec![2]);
    let repaired = repair_latest(store).await.unwrap().unwrap();
    assert_eq!(repaired.version, 2);
    assert_eq!(
        read_latest(store, None).await.unwrap().unwrap().0.version,
        2
    );

    // A corrupt manifest in the bucket is refused with a reason, not trusted.
    store
        .put(
            "versions/00000000000000000003.json",
            Bytes::from_static(b"{\"format\":\"x\"}"),
        )
        .await
        .unwrap();
    let err = read_manifest(store, 3).await.unwrap_err().to_string();
    assert!(err.contains("manifest"), "{err}");
}

#[tokio::test]
async fn protocol_on_memory() {
    protocol_suite(&Store::open("memory:///p").unwrap()).await;
}

#[tokio::test]
async fn protocol_on_local_filesystem() {
    let (store, _dir) = common::local_store();
    protocol_suite(&store).await;
}

#[tokio::test]
async fn protocol_on_s3_moto() {
    let store = common::moto_store("protocol", "run").await;
    protocol_suite(&store).await;
}
