//! The store layer against every backend the suite can run: in-memory, local
//! filesystem and S3 (moto, a real server on loopback).

use crate::common;

use bytes::Bytes;
use weightcast::store::{ConditionalWrites, Created, Fetched, Store};

fn opts(v: &[(String, String)]) -> Vec<(&str, &str)> {
    v.iter().map(|(k, x)| (k.as_str(), x.as_str())).collect()
}

/// What every backend must do.
async fn conformance(store: &Store, etags: bool) {
    // Round trip, missing keys, listing in key order.
    store.put("a/1", Bytes::from_static(b"one")).await.unwrap();
    store.put("a/0", Bytes::from_static(b"zero")).await.unwrap();
    store.put("b", Bytes::from_static(b"bee")).await.unwrap();
    assert_eq!(
        store.get("a/1").await.unwrap().as_deref(),
        Some(&b"one"[..])
    );
    assert_eq!(store.get("nope").await.unwrap(), None);
    let keys: Vec<String> = store
        .list("a")
        .await
        .unwrap()
        .into_iter()
        .map(|l| l.key)
        .collect();
    assert_eq!(keys, vec!["a/0", "a/1"]);
    let all = store.list("").await.unwrap();
    assert!(all.iter().any(|l| l.key == "b" && l.size == 3), "{all:?}");

    // Overwrite, delete, delete of a missing key.
    store.put("b", Bytes::from_static(b"bee2")).await.unwrap();
    assert_eq!(store.get("b").await.unwrap().as_deref(), Some(&b"bee2"[..]));
    store.delete("b").await.unwrap();
    store.delete("b").await.unwrap();
    assert_eq!(store.get("b").await.unwrap(), None);

    // Keys cannot climb out of the prefix.
    assert!(store.put("../escape", Bytes::new()).await.is_err());
    assert!(store.get("a/../../x").await.is_err());

    // Conditional reads: an unchanged object costs no body.
    if etags {
        let Fetched::Body { etag, .. } = store.fetch("a/1", None).await.unwrap() else {
            panic!("a/1 exists");
        };
        let etag = etag.expect("store reports ETags");
        assert_eq!(
            store.fetch("a/1", Some(&etag)).await.unwrap(),
            Fetched::NotModified
        );
        store.put("a/1", Bytes::from_static(b"uno")).await.unwrap();
        match store.fetch("a/1", Some(&etag)).await.unwrap() {
            Fetched::Body { bytes, etag: e2 } => {
                assert_eq!(&bytes[..], b"uno");
                assert_ne!(e2.as_deref(), Some(etag.as_str()));
            }
            other => panic!("changed object not returned: {other:?}"),
        }
    }
    assert_eq!(
        store.fetch("missing", None).await.unwrap(),
        Fetched::Missing
    );

    // Size limits are enforced from the object's size, before its body is read.
    store
        .put("sized", Bytes::from(vec![7u8; 100]))
        .await
        .unwrap();
    assert_eq!(
        store
            .get_at_most("sized", 100)
            .await
            .unwrap()
            .map(|b| b.len()),
        Some(100)
    );
    match store.get_at_most("sized", 99).await {
        Err(weightcast::Error::TooLarge {
            size: 100, max: 99, ..
        }) => {}
        other => panic!("oversized object accepted: {other:?}"),
    }
    assert!(store.fetch_at_most("sized", None, 10).await.is_err());
    assert_eq!(store.get_at_most("missing", 1).await.unwrap(), None);
}

/// Stores that enforce create-if-absent: one winner among racers.
async fn one_writer_per_key(store: &Store) {
    assert_eq!(
        store.probe_conditional_writes().await.unwrap(),
        ConditionalWrites::Enforced
    );
    assert_eq!(
        store.create("c/x", Bytes::from_static(b"1")).await.unwrap(),
        Created::Created
    );
    assert_eq!(
        store.create("c/x", Bytes::from_static(b"2")).await.unwrap(),
        Created::AlreadyExists
    );
    assert_eq!(store.get("c/x").await.unwrap().as_deref(), Some(&b"1"[..]));
    // Eight concurrent creators of one key: exactly one wins, and its bytes stay.
    let racers: Vec<_> = (0..8u8)
        .map(|i| {
            let s = store.clone();
            tokio::spawn(
                async move { (i, s.create("c/race", Bytes::from(vec![i])).await.unwrap()) },
            )
        })
        .collect();
    let mut winners = Vec::new();
    for r in racers {
        let (i, outcome) = r.await.unwrap();
        if outcome == Created::Created {
            winners.push(i);
        }
    }
    assert_eq!(winners.len(), 1, "winners: {winners:?}");
    assert_eq!(
        store.get("c/race").await.unwrap().as_deref(),
        Some(&[winners[0]][..])
    );
}

/// Counts what a store reports to its progress observer.
#[derive(Debug, Default)]
struct Recorder {
    started: std::sync::Mutex<Vec<(String, u64)>>,
    advanced: std::sync::atomic::AtomicU64,
}

impl weightcast::store::Progress for Recorder {
    fn started(&self, key: &str, bytes: u64) {
        self.started.lock().unwrap().push((key.to_string(), bytes));
    }
    fn advanced(&self, bytes: u64) {
        self.advanced
            .fetch_add(bytes, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Objects above the multipart threshold round-trip, and their upload is
/// reported part by part.
async fn large_object(store: &Store) {
    let n = weightcast::store::MULTIPART_THRESHOLD + weightcast::store::PART_SIZE / 2 + 7;
    let data: Vec<u8> = (0..n).map(|i| (i * 131 % 251) as u8).collect();
    let progress = std::sync::Arc::new(Recorder::default());
    let reporting = store.clone().with_progress(progress.clone());
    reporting
        .put("big/object", Bytes::from(data.clone()))
        .await
        .unwrap();
    reporting
        .put("small", Bytes::from_static(b"tiny"))
        .await
        .unwrap();
    assert_eq!(
        *progress.started.lock().unwrap(),
        vec![
            ("big/object".to_string(), n as u64),
            ("small".to_string(), 4)
        ]
    );
    assert_eq!(
        progress.advanced.load(std::sync::atomic::Ordering::Relaxed),
        n as u64 + 4
    );
    let back = store
        .get("big/object")
        .await
        .unwrap()
        .expect("big object exists");
    assert_eq!(back.len(), n);
    assert!(back[..] == data[..], "multipart bytes differ");

    // Ranged downloads report each byte once to the download observer.
    let down = std::sync::Arc::new(Recorder::default());
    let reading = store.clone().with_download_progress(down.clone());
    let assembled = std::sync::Mutex::new(vec![0u8; n]);
    reading
        .download_ranges(
            "big/object",
            n as u64,
            1 << 20,
            3,
            |at, b| {
                assembled.lock().unwrap()[at as usize..at as usize + b.len()].copy_from_slice(b);
                Ok(())
            },
            |_| {},
        )
        .await
        .unwrap();
    assert!(
        assembled.into_inner().unwrap() == data,
        "ranged bytes differ"
    );
    assert_eq!(
        *down.started.lock().unwrap(),
        vec![("big/object".to_string(), n as u64)]
    );
    assert_eq!(
        down.advanced.load(std::sync::atomic::Ordering::Relaxed),
        n as u64
    );

    // The same bytes streamed from a file, part by part, and a small file.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("anchor.safetensors");
    std::fs::write(&path, &data).unwrap();
    store.put_file("big/from-file", &path).await.unwrap();
    let back = store.get("big/from-file").await.unwrap().unwrap();
    assert!(back[..] == data[..], "streamed multipart bytes differ");
    std::fs::write(&path, b"small").unwrap();
    store.put_file("small-file", &path).await.unwrap();
    assert_eq!(
        store.get("small-file").await.unwrap().as_deref(),
        Some(&b"small"[..])
    );
    assert!(
        store
            .put_file("missing", &dir.path().join("nope"))
            .await
            .is_err()
    );
}

#[tokio::test]
async fn memory_store() {
    let store = Store::open("memory:///some/prefix").unwrap();
    conformance(&store, true).await;
    one_writer_per_key(&store).await;
    large_object(&store).await;
}

#[tokio::test]
async fn local_filesystem_store() {
    let dir = tempfile::tempdir().unwrap();
    let url = url::Url::from_directory_path(dir.path().join("bucket")).unwrap();
    let store = Store::open(url.as_str()).unwrap();
    conformance(&store, true).await;
    one_writer_per_key(&store).await;
    large_object(&store).await;
    // Everything stayed inside the directory.
    assert!(dir.path().join("bucket/a/0").exists());
}

#[tokio::test]
async fn s3_store_on_moto() {
    common::moto_bucket("weights").await;
    let o = common::moto_options();
    let store = Store::open_with("s3://weights/run-1", &opts(&o)).unwrap();
    conformance(&store, true).await;
    one_writer_per_key(&store).await;
    large_object(&store).await;
    // The prefix is honoured on the server side.
    let root = Store::open_with("s3://weights", &opts(&o)).unwrap();
    assert!(root.get("run-1/a/0").await.unwrap().is_some());
}

/// The Hugging Face preset: `hf://buckets/<namespace>/<bucket>/prefix` is an
/// S3 store at `<gateway>/<namespace>` with path-style requests. Pointed at
/// moto, the namespace is the first path segment moto sees, i.e. its bucket, so
/// the objects must land at `<namespace>/<bucket>/<prefix>/…` there: that proves
/// the endpoint, addressing and signing are composed as the gateway expects for
/// object requests. (Listing and bulk deletes are bucket requests, `GET
/// <gateway>/<namespace>/<bucket>?list-type=2` and `POST …?delete`, which the
/// gateway serves and moto, having no namespaces, cannot.)
#[tokio::test]
async fn hugging_face_preset_on_moto() {
    common::moto_bucket("hf-namespace").await;
    let port = common::moto().port;
    let gateway = format!("http://127.0.0.1:{port}");
    let options = [
        ("hf_endpoint", gateway.as_str()),
        ("aws_access_key_id", "HFAKtest"),
        ("aws_secret_access_key", "secret"),
    ];
    let store = Store::open_with("hf://buckets/hf-namespace/weights/run-7", &options).unwrap();
    store.put("a/0", Bytes::from_static(b"zero")).await.unwrap();
    assert_eq!(
        store.get("a/0").await.unwrap().as_deref(),
        Some(&b"zero"[..])
    );
    assert_eq!(store.get("a/1").await.unwrap(), None);
    assert_eq!(
        store.create("c/x", Bytes::from_static(b"1")).await.unwrap(),
        Created::Created
    );
    assert_eq!(
        store.create("c/x", Bytes::from_static(b"2")).await.unwrap(),
        Created::AlreadyExists
    );
    let o = common::moto_options();
    let raw = Store::open_with("s3://hf-namespace", &opts(&o)).unwrap();
    assert_eq!(
        raw.get("weights/run-7/a/0").await.unwrap().as_deref(),
        Some(&b"zero"[..])
    );
    assert_eq!(
        raw.get("weights/run-7/c/x").await.unwrap().as_deref(),
        Some(&b"1"[..])
    );
    for bad in [
        "hf://buckets/only-namespace",
        "hf://models/x/y",
        "hf://buckets//b",
    ] {
        match Store::open_with(bad, &options) {
            Ok(_) => panic!("{bad} accepted"),
            Err(e) => assert!(
                e.to_string().contains("hf://buckets/<namespace>"),
                "{bad}: {e}"
            ),
        }
    }
}

#[tokio::test]
async fn bad_urls_are_refused_with_the_reason() {
    for (url, needle) in [
        ("ftp://x/y", "unknown scheme"),
        ("not a url", "store URL"),
        ("s3://weights", ""),
    ] {
        match Store::open_with(url, &[("aws_no_such_option", "1")]) {
            Ok(_) => panic!("{url} accepted"),
            Err(e) => assert!(e.to_string().contains(needle), "{url}: {e}"),
        }
    }
}

/// Garage 2.5, a real S3-compatible store that accepts `If-None-Match: *` and
/// overwrites anyway: everything else conforms, and the probe catches it.
#[tokio::test]
async fn s3_store_on_garage_ignores_conditions_and_is_detected() {
    let g = common::garage();
    let o = common::garage_options();
    let store = Store::open_with(&format!("s3://{}/run-g", g.bucket), &opts(&o)).unwrap();
    conformance(&store, true).await;
    large_object(&store).await;
    assert_eq!(
        store.probe_conditional_writes().await.unwrap(),
        ConditionalWrites::Ignored
    );
    // What the probe protects against: both creators are told they won, and
    // the second one's bytes replaced the first's.
    assert_eq!(
        store.create("c/x", Bytes::from_static(b"1")).await.unwrap(),
        Created::Created
    );
    assert_eq!(
        store.create("c/x", Bytes::from_static(b"2")).await.unwrap(),
        Created::Created
    );
    assert_eq!(store.get("c/x").await.unwrap().as_deref(), Some(&b"2"[..]));
}
