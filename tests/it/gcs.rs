//! Google Cloud Storage through object_store's GCS client, against
//! fake-gcs-server on loopback.
//!
//! object_store writes to GCS through the XML API (`PUT /<bucket>/<object>`),
//! which fake-gcs-server does not implement (it answers `400 invalid
//! uploadType`; it implements the JSON upload API), so the publisher cannot
//! write to it. What runs here is the read side, for real: a bucket published
//! on a local store is copied into GCS through the JSON API, and subscribers
//! read it through `gs://` — listing, manifests, the `latest.json` hint, every
//! object — verify it and converge bit-identically; a corrupted object in GCS
//! is refused. A canary test fails the day object_store's writes start working
//! against the emulator, so the publisher suites can be pointed at it.

use crate::common;

use std::collections::BTreeMap;

use bytes::Bytes;
use weightcast::generator::{Generator, GeneratorConfig};
use weightcast::publisher::Publisher;
use weightcast::store::Store;
use weightcast::subscriber::catch_up;

fn gcs_store(bucket: &str, prefix: &str) -> Store {
    let o = common::fake_gcs_options();
    let opts: Vec<(&str, &str)> = o.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    Store::open_with(&format!("gs://{bucket}/{prefix}"), &opts).unwrap()
}

/// Copies every object of `from` into GCS under `bucket/prefix`.
async fn mirror(from: &Store, bucket: &str, prefix: &str) {
    for l in from.list("").await.unwrap() {
        let body = from.get(&l.key).await.unwrap().unwrap();
        common::fake_gcs_upload(bucket, &format!("{prefix}/{}", l.key), body.to_vec()).await;
    }
}

fn read_current(dir: &std::path::Path) -> BTreeMap<String, Vec<u8>> {
    std::fs::read_dir(dir.join("current"))
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            (
                e.file_name().into_string().unwrap(),
                std::fs::read(e.path()).unwrap(),
            )
        })
        .collect()
}

#[tokio::test]
async fn subscribers_read_and_verify_a_gcs_bucket() {
    common::fake_gcs_bucket("weights").await;
    let work = tempfile::tempdir().unwrap();
    let (local, _guard) = common::local_store();
    let mut p = Publisher::open(
        local.clone(),
        common::publisher_config(&work.path().join("state"), 3, None),
    )
    .await
    .unwrap();
    let mut g = Generator::new(GeneratorConfig::tiny(3));
    let gcs = gcs_store("weights", "run");
    let early = work.path().join("early");
    for v in 0..5u64 {
        if v > 0 {
            g.step();
        }
        let dir = work.path().join(format!("ckpt-{v}"));
        std::fs::create_dir_all(&dir).unwrap();
        let mut f = std::fs::File::create(dir.join("model.safetensors")).unwrap();
        g.snapshot().write_to(&BTreeMap::new(), &mut f).unwrap();
        p.publish_path(&dir.join("model.safetensors"), &Default::default())
            .await
            .unwrap();
        if v == 1 {
            mirror(&local, "weights", "run").await;
            let c = catch_up(&gcs, &early).await.unwrap().unwrap();
            assert_eq!((c.version, c.from_anchor), (1, true));
        }
    }
    mirror(&local, "weights", "run").await;

    // The hint. (Real GCS answers a read with a matching `If-None-Match` with
    // 304; the emulator ignores the header and sends the body again, which a
    // reader must — and does — accept.)
    let (latest, etag) = weightcast::protocol::read_latest(&gcs, None)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(latest.version, 4);
    let etag = etag.expect("GCS reports ETags");
    if let Some((again, _)) = weightcast::protocol::read_latest(&gcs, Some(&etag))
        .await
        .unwrap()
    {
        assert_eq!(again, latest);
    }

    // The early subscriber replays across the bridged anchor at 3; a late
    // joiner bootstraps; both match a subscriber of the local bucket.
    let c = catch_up(&gcs, &early).await.unwrap().unwrap();
    assert_eq!((c.version, c.from_anchor, c.deltas_applied), (4, false, 3));
    let late = work.path().join("late");
    let c = catch_up(&gcs, &late).await.unwrap().unwrap();
    assert_eq!((c.version, c.from_anchor), (4, true));
    let reference = work.path().join("reference");
    catch_up(&local, &reference).await.unwrap().unwrap();
    let want = read_current(&reference);
    assert_eq!(read_current(&early), want);
    assert_eq!(read_current(&late), want);

    // A corrupted delta in GCS is refused; the subscriber keeps version 4.
    g.step();
    let dir = work.path().join("ckpt-5");
    std::fs::create_dir_all(&dir).unwrap();
    let mut f = std::fs::File::create(dir.join("model.safetensors")).unwrap();
    g.snapshot().write_to(&BTreeMap::new(), &mut f).unwrap();
    p.publish_path(&dir.join("model.safetensors"), &Default::default())
        .await
        .unwrap();
    mirror(&local, "weights", "run").await;
    let m5 = weightcast::protocol::read_manifest(&gcs, 5)
        .await
        .unwrap()
        .unwrap();
    let key = &m5.objects[0].key;
    let mut body = gcs.get(key).await.unwrap().unwrap().to_vec();
    let mid = body.len() / 2;
    body[mid] ^= 0x40;
    common::fake_gcs_upload("weights", &format!("run/{key}"), body).await;
    // Quarantined: version 4 stays, version 5 is reported with the reason.
    let c = catch_up(&gcs, &early).await.unwrap().unwrap();
    assert_eq!(c.version, 4, "{c:?}");
    assert_eq!(c.quarantined.len(), 1, "{c:?}");
    let err = &c.quarantined[0].error;
    assert_eq!(c.quarantined[0].version, 5);
    assert!(
        err.contains("integrity") && err.contains(key.as_str()),
        "{err}"
    );
    assert_eq!(read_current(&early), want);
}

/// The canary: object_store's XML-API writes against fake-gcs-server. When
/// this starts failing, writes work and the publisher suites should run here.
#[tokio::test]
async fn object_store_writes_are_refused_by_the_emulator() {
    common::fake_gcs_bucket("canary").await;
    let gcs = gcs_store("canary", "x");
    let err = gcs
        .put("k", Bytes::from_static(b"v"))
        .await
        .expect_err("fake-gcs-server accepted an XML-API write: enable the GCS publisher tests")
        .to_string();
    assert!(
        err.contains("invalid uploadType") || err.contains("400"),
        "{err}"
    );
}
