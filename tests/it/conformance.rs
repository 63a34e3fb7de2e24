//! The store conformance suite: every operation the bucket protocol relies
//! on, run against every backend the suite can start — in-memory, local
//! filesystem, S3 (moto, and Garage without conditional writes), GCS
//! (fake-gcs-server) and Azure Blob (Azurite) — one `#[tokio::test]` each.
//!
//! Where backends differ the difference is part of the backend's
//! [`Expect`] and asserted, never skipped: which enforce create-if-absent
//! (and what the probe reports), which answer a matching `If-None-Match`
//! with 304, and which accept object_store's writes at all (fake-gcs-server
//! refuses its XML-API uploads, so that backend is seeded through its JSON
//! API and its write side is asserted refused).
//!
//! `WEIGHTCAST_LONG=1` lists past S3's 1000-key page and uploads a larger
//! multipart object.

use crate::common;

use bytes::Bytes;
use weightcast::protocol::{self, Commit, Manifest, ObjectRole, Staging, VersionKind};
use weightcast::publisher::Publisher;
use weightcast::store::{ConditionalWrites, Created, Fetched, Source, Store};

/// What a backend does where backends differ.
struct Expect {
    /// What a second create-if-absent of a key does (and the probe reports).
    conditional: ConditionalWrites,
    /// Whether a read with the current ETag is answered 304 (else the body
    /// comes back again, which readers must accept).
    not_modified: bool,
    /// How objects get into the bucket.
    writes: Writes,
}

impl Expect {
    /// What a faithful store does: enforces creates, answers 304, takes
    /// object_store's writes.
    fn faithful() -> Expect {
        Expect {
            conditional: ConditionalWrites::Enforced,
            not_modified: true,
            writes: Writes::ObjectStore,
        }
    }
}

enum Writes {
    /// Through object_store, like the publisher.
    ObjectStore,
    /// object_store's writes are refused (fake-gcs-server implements only
    /// the JSON upload API): objects are seeded through that API instead.
    GcsJsonApi { bucket: String, prefix: String },
}

struct Backend {
    name: &'static str,
    store: Store,
    expect: Expect,
}

impl Backend {
    fn writes(&self) -> bool {
        matches!(self.expect.writes, Writes::ObjectStore)
    }

    /// Puts an object the way this backend is written to.
    async fn seed(&self, key: &str, bytes: Bytes) {
        match &self.expect.writes {
            Writes::ObjectStore => self.store.put(key, bytes).await.unwrap(),
            Writes::GcsJsonApi { bucket, prefix } => {
                common::fake_gcs_upload(bucket, &format!("{prefix}/{key}"), bytes.to_vec()).await
            }
        }
    }

    /// Copies every object of `from` into this backend.
    async fn mirror(&self, from: &Store) {
        for l in from.list("").await.unwrap() {
            let body = from.get(&l.key).await.unwrap().unwrap();
            self.seed(&l.key, body).await;
        }
    }
}

fn opts(v: &[(String, String)]) -> Vec<(&str, &str)> {
    v.iter().map(|(k, x)| (k.as_str(), x.as_str())).collect()
}

/// The whole suite, in order; each step names the backend in its failures.
async fn suite(b: &Backend) {
    reads_and_listing(b).await;
    bounded_reads(b).await;
    conditional_reads(b).await;
    listing_after(b).await;
    conditional_creates(b).await;
    multipart(b).await;
    growing(b).await;
    commits(b).await;
    round_trip(b).await;
}

async fn reads_and_listing(b: &Backend) {
    let (s, n) = (&b.store, b.name);
    b.seed("a/1", Bytes::from_static(b"one")).await;
    b.seed("a/0", Bytes::from_static(b"zero")).await;
    b.seed("b", Bytes::from_static(b"bee")).await;
    assert_eq!(
        s.get("a/1").await.unwrap().as_deref(),
        Some(&b"one"[..]),
        "{n}"
    );
    assert_eq!(s.get("nope").await.unwrap(), None, "{n}");
    let listed = s.list("a").await.unwrap();
    let keys: Vec<(&str, u64)> = listed.iter().map(|l| (l.key.as_str(), l.size)).collect();
    assert_eq!(keys, [("a/0", 4), ("a/1", 3)], "{n}: listing in key order");
    assert!(
        s.list("").await.unwrap().iter().any(|l| l.key == "b"),
        "{n}: root listing"
    );
    // An overwrite is read back.
    b.seed("b", Bytes::from_static(b"bee2")).await;
    assert_eq!(
        s.get("b").await.unwrap().as_deref(),
        Some(&b"bee2"[..]),
        "{n}"
    );
    // Keys cannot climb out of the prefix, on any backend.
    assert!(s.put("../escape", Bytes::new()).await.is_err(), "{n}");
    assert!(s.get("a/../../x").await.is_err(), "{n}");
    assert!(s.delete("a/../../x").await.is_err(), "{n}");
    // Deletes (and deletes of missing keys) succeed where writes do.
    let deleted = s.delete("b").await;
    if b.writes() {
        deleted.unwrap();
        s.delete("b").await.unwrap();
        assert_eq!(s.get("b").await.unwrap(), None, "{n}: deleted");
    }
}

async fn bounded_reads(b: &Backend) {
    let (s, n) = (&b.store, b.name);
    b.seed("sized", Bytes::from(vec![7u8; 100])).await;
    assert_eq!(
        s.get_at_most("sized", 100).await.unwrap().map(|b| b.len()),
        Some(100),
        "{n}"
    );
    match s.get_at_most("sized", 99).await {
        Err(weightcast::Error::TooLarge {
            size: 100, max: 99, ..
        }) => {}
        other => panic!("{n}: an oversized object was accepted: {other:?}"),
    }
    assert!(s.fetch_at_most("sized", None, 10).await.is_err(), "{n}");
    assert_eq!(s.get_at_most("missing", 1).await.unwrap(), None, "{n}");
    assert_eq!(
        s.fetch("missing", None).await.unwrap(),
        Fetched::Missing,
        "{n}"
    );
}

async fn conditional_reads(b: &Backend) {
    let (s, n) = (&b.store, b.name);
    b.seed("etag", Bytes::from_static(b"v1")).await;
    let Fetched::Body { etag, .. } = s.fetch("etag", None).await.unwrap() else {
        panic!("{n}: etag exists");
    };
    let etag = etag.unwrap_or_else(|| panic!("{n} reports no ETag"));
    match s.fetch("etag", Some(&etag)).await.unwrap() {
        Fetched::NotModified => assert!(b.expect.not_modified, "{n} now answers 304"),
        Fetched::Body { bytes, etag: e } => {
            assert!(!b.expect.not_modified, "{n}: unchanged object sent again");
            assert_eq!(
                (&bytes[..], e.as_deref()),
                (&b"v1"[..], Some(etag.as_str()))
            );
        }
        Fetched::Missing => panic!("{n}: object vanished"),
    }
    b.seed("etag", Bytes::from_static(b"v2")).await;
    match s.fetch("etag", Some(&etag)).await.unwrap() {
        Fetched::Body { bytes, etag: e } => {
            assert_eq!(&bytes[..], b"v2", "{n}");
            assert_ne!(e.as_deref(), Some(etag.as_str()), "{n}: same ETag");
        }
        other => panic!("{n}: changed object not returned: {other:?}"),
    }
}

/// `list_after` — how a subscriber finds new versions with one request —
/// returns exactly the keys after the given one, across listing pages.
async fn listing_after(b: &Backend) {
    let (s, n) = (&b.store, b.name);
    let count = common::scaled(30u64, 1100);
    let seeded: Vec<String> = (0..count).map(|v| format!("list/{v:020}.json")).collect();
    futures::future::join_all(seeded.iter().map(|k| b.seed(k, Bytes::from_static(b"{}")))).await;
    for after in [0, 1, count / 2, count - 2, count - 1] {
        let got: Vec<String> = s
            .list_after("list", &seeded[after as usize])
            .await
            .unwrap()
            .into_iter()
            .map(|l| l.key)
            .collect();
        assert_eq!(got, seeded[after as usize + 1..], "{n}: after {after}");
    }
    assert_eq!(s.list("list").await.unwrap().len() as u64, count, "{n}");
}

async fn conditional_creates(b: &Backend) {
    let (s, n) = (&b.store, b.name);
    let probed = s.probe_conditional_writes().await;
    let first = s.create("c/x", Bytes::from_static(b"1")).await;
    if !b.writes() {
        // The probe and creates fail loudly rather than report anything.
        assert!(probed.is_err() && first.is_err(), "{n}: writes now work");
        return;
    }
    assert_eq!(probed.unwrap(), b.expect.conditional, "{n}: probe");
    assert_eq!(first.unwrap(), Created::Created, "{n}");
    let second = s.create("c/x", Bytes::from_static(b"2")).await.unwrap();
    let kept = s.get("c/x").await.unwrap();
    match b.expect.conditional {
        ConditionalWrites::Enforced => {
            assert_eq!(second, Created::AlreadyExists, "{n}");
            assert_eq!(kept.as_deref(), Some(&b"1"[..]), "{n}: first bytes kept");
        }
        ConditionalWrites::Ignored => {
            // Both creators are told they won and the second overwrote.
            assert_eq!(second, Created::Created, "{n}");
            assert_eq!(kept.as_deref(), Some(&b"2"[..]), "{n}");
        }
    }
    // Eight concurrent creators of one key.
    let racers: Vec<_> = (0..8u8)
        .map(|i| {
            let s = s.clone();
            tokio::spawn(async move { (i, s.create("c/race", Bytes::from(vec![i])).await) })
        })
        .collect();
    let mut winners = Vec::new();
    for r in racers {
        let (i, outcome) = r.await.unwrap();
        if outcome.unwrap() == Created::Created {
            winners.push(i);
        }
    }
    let kept = s.get("c/race").await.unwrap().unwrap();
    assert!(winners.contains(&kept[0]), "{n}: kept bytes of a loser");
    if b.expect.conditional == ConditionalWrites::Enforced {
        assert_eq!(winners.len(), 1, "{n}: winners {winners:?}");
    }
    // The probe leaves nothing behind.
    assert!(s.list("_weightcast").await.unwrap().is_empty(), "{n}");
}

/// An object above the multipart threshold, put from memory and a file piece
/// (as anchors are): the size and BLAKE3 returned are those of the bytes, and
/// the object reads back whole.
async fn multipart(b: &Backend) {
    let (s, n) = (&b.store, b.name);
    let len = common::scaled(
        weightcast::store::MULTIPART_THRESHOLD + weightcast::store::PART_SIZE / 2 + 7,
        weightcast::store::MULTIPART_THRESHOLD * 4 + 3,
    );
    let data: Vec<u8> = (0..len).map(|i| (i * 131 % 251) as u8).collect();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("tail");
    let head = 1000usize;
    std::fs::write(&file, &data[head..]).unwrap();
    let sources = [
        Source::Bytes(Bytes::copy_from_slice(&data[..head])),
        Source::File {
            path: file,
            offset: 0,
            len: (len - head) as u64,
        },
    ];
    let put = s.put_sources("big/object", &sources).await;
    if !b.writes() {
        assert!(put.is_err(), "{n}: multipart writes now work");
        return;
    }
    let (size, blake3) = put.unwrap();
    assert_eq!(size, len as u64, "{n}");
    assert_eq!(blake3, blake3::hash(&data).to_hex().to_string(), "{n}");
    let listed = s.list("big").await.unwrap();
    assert_eq!(listed.first().map(|l| l.size), Some(len as u64), "{n}");
    let back = s.get("big/object").await.unwrap().unwrap();
    assert!(
        back.len() == len && back[..] == data[..],
        "{n}: bytes differ"
    );
    s.delete("big/object").await.unwrap();
}

/// An object uploaded while its data is being written, its head reserved
/// first and sent last (as `planes` anchors go up): three parts, the first
/// sent after the others, read back whole with the size and BLAKE3 returned.
/// A writer that stops half-way leaves no object.
async fn growing(b: &Backend) {
    let (s, n) = (&b.store, b.name);
    let part = weightcast::store::PART_SIZE;
    let head: Vec<u8> = (0..4096u32).map(|i| (i * 7 % 253) as u8).collect();
    let data: Vec<u8> = (0..2 * part + 12_345)
        .map(|i| (i * 131 % 251) as u8)
        .collect();
    let dir = tempfile::tempdir().unwrap();
    let (writer, growing) = weightcast::store::growing(&dir.path().join("spill")).unwrap();
    let feed = {
        let (head, data) = (head.clone(), data.clone());
        std::thread::spawn(move || {
            use std::io::Write;
            let mut w = writer;
            // Irregular pieces, with pauses: the upload runs ahead of it.
            for piece in data.chunks(3_000_017) {
                w.write_all(piece).unwrap();
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
            w.finish(head);
        })
    };
    let put = s.put_growing("grown/object", head.len(), growing).await;
    feed.join().unwrap();
    if !b.writes() {
        assert!(put.is_err(), "{n}: growing writes now work");
        return;
    }
    let (size, blake3) = put.unwrap();
    let mut whole = head.clone();
    whole.extend_from_slice(&data);
    assert_eq!(size, whole.len() as u64, "{n}");
    assert_eq!(blake3, blake3::hash(&whole).to_hex().to_string(), "{n}");
    let back = s.get("grown/object").await.unwrap().unwrap();
    assert!(back[..] == whole[..], "{n}: grown object's bytes differ");
    s.delete("grown/object").await.unwrap();
    // A writer that stops without finishing: an error, and no object.
    let (mut writer, growing) = weightcast::store::growing(&dir.path().join("spill2")).unwrap();
    let feed = std::thread::spawn(move || {
        use std::io::Write;
        writer.write_all(&vec![5u8; part + part / 2]).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(50));
        drop(writer);
    });
    let put = s.put_growing("grown/torn", head.len(), growing).await;
    feed.join().unwrap();
    assert!(put.is_err(), "{n}: a torn growing upload succeeded");
    assert_eq!(s.get("grown/torn").await.unwrap(), None, "{n}: torn object");
}

/// A manifest by each of two writers for one version: on stores that enforce
/// create-if-absent exactly one commits.
async fn commits(b: &Backend) {
    let (s, n) = (&b.store, b.name);
    let manifest = |version: u64| -> Manifest {
        let mut st = Staging::new(version);
        let key = st.key(ObjectRole::Anchor, "model.safetensors").unwrap();
        st.record(weightcast::protocol::ObjectEntry {
            name: "model.safetensors".into(),
            role: ObjectRole::Anchor,
            key,
            size: 1,
            blake3: "0".repeat(64),
        });
        st.manifest(VersionKind::Anchor, None, version, None)
    };
    let (m1, m2) = (manifest(7), manifest(7));
    let (r1, r2) = tokio::join!(protocol::commit(s, &m1), protocol::commit(s, &m2));
    if !b.writes() {
        assert!(r1.is_err() && r2.is_err(), "{n}: commits now work");
        return;
    }
    let (r1, r2) = (r1.unwrap(), r2.unwrap());
    let stored = protocol::read_manifest(s, 7).await.unwrap().unwrap();
    match b.expect.conditional {
        ConditionalWrites::Enforced => {
            let winner = match (r1, r2) {
                (Commit::Committed, Commit::VersionTaken) => &m1,
                (Commit::VersionTaken, Commit::Committed) => &m2,
                other => panic!("{n}: not exactly one winner: {other:?}"),
            };
            assert_eq!(&stored, winner, "{n}: the winner's manifest");
        }
        ConditionalWrites::Ignored => {
            assert_eq!((r1, r2), (Commit::Committed, Commit::Committed), "{n}");
            assert!(stored == m1 || stored == m2, "{n}");
        }
    }
    assert_eq!(
        protocol::versions_after(s, Some(6)).await.unwrap(),
        [7],
        "{n}"
    );
    s.delete(&protocol::manifest_key(7)).await.unwrap();
}

/// A publisher commits an anchor, deltas and a bridged anchor; a subscriber
/// that followed along and a late joiner both end bit-identical.
async fn round_trip(b: &Backend) {
    let n = b.name;
    let work = tempfile::tempdir().unwrap();
    // Publishing happens on this backend, or (no writes) on a local bucket
    // mirrored into it.
    let (local, _guard) = common::local_store();
    let target = if b.writes() { &b.store } else { &local };
    let mut cfg = common::publisher_config(&work.path().join("state"), 3, None);
    if b.expect.conditional == ConditionalWrites::Ignored && b.writes() {
        let refused = Publisher::open(target.clone(), cfg.clone()).await;
        match refused {
            Err(e) => assert!(e.to_string().contains("does not enforce"), "{n}: {e}"),
            Ok(_) => panic!("{n}: a publisher opened a store that ignores conditional writes"),
        }
        cfg.single_writer = true;
    }
    let mut p = Publisher::open(target.clone(), cfg).await.unwrap();
    let mut t = common::Trainer::new(21);
    let follower = work.path().join("follower");
    for v in 0..5u64 {
        if v > 0 {
            t.step();
        }
        let out = p
            .publish(t.checkpoint(), &Default::default())
            .await
            .unwrap();
        assert_eq!(out.version, v, "{n}");
        if !b.writes() {
            b.mirror(&local).await;
        }
        let c = weightcast::subscriber::catch_up(&b.store, &follower)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(c.version, v, "{n}");
        common::assert_replica(&follower, &t.weights(), &t.config(), n);
    }
    let late = work.path().join("late");
    let c = weightcast::subscriber::catch_up(&b.store, &late)
        .await
        .unwrap()
        .unwrap();
    assert_eq!((c.version, c.from_anchor), (4, true), "{n}");
    common::assert_replica(&late, &t.weights(), &t.config(), n);
    let (latest, _) = protocol::read_latest(&b.store, None)
        .await
        .unwrap()
        .unwrap();
    assert_eq!((latest.version, latest.anchor_version), (4, 3), "{n}");
}

#[tokio::test]
async fn conformance_memory() {
    suite(&Backend {
        name: "memory",
        store: Store::open("memory:///conformance").unwrap(),
        expect: Expect::faithful(),
    })
    .await;
}

#[tokio::test]
async fn conformance_local() {
    let (store, _dir) = common::local_store();
    suite(&Backend {
        name: "local",
        store,
        expect: Expect::faithful(),
    })
    .await;
}

#[tokio::test]
async fn conformance_s3_moto() {
    suite(&Backend {
        name: "moto",
        store: common::moto_store("conformance", "run").await,
        expect: Expect::faithful(),
    })
    .await;
}

/// Garage 2.5 accepts `If-None-Match: *` and overwrites anyway: the probe
/// reports it and a publisher needs `--single-writer`.
#[tokio::test]
async fn conformance_s3_garage() {
    let g = common::garage();
    let o = common::garage_options();
    suite(&Backend {
        name: "garage",
        store: Store::open_with(&format!("s3://{}/conformance", g.bucket), &opts(&o)).unwrap(),
        expect: Expect {
            conditional: ConditionalWrites::Ignored,
            not_modified: true,
            writes: Writes::ObjectStore,
        },
    })
    .await;
}

/// fake-gcs-server: object_store's writes are refused, and a matching
/// `If-None-Match` is ignored (real GCS answers 304).
#[tokio::test]
async fn conformance_gcs_fake_gcs_server() {
    common::fake_gcs_bucket("conformance").await;
    let o = common::fake_gcs_options();
    suite(&Backend {
        name: "fake-gcs-server",
        store: Store::open_with("gs://conformance/run", &opts(&o)).unwrap(),
        expect: Expect {
            conditional: ConditionalWrites::Ignored,
            not_modified: false,
            writes: Writes::GcsJsonApi {
                bucket: "conformance".into(),
                prefix: "run".into(),
            },
        },
    })
    .await;
}

#[tokio::test]
async fn conformance_azure_azurite() {
    suite(&Backend {
        name: "azurite",
        store: common::azurite_store("conformance", "run"),
        expect: Expect::faithful(),
    })
    .await;
}
