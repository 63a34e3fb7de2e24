//! Hostile input in the bucket: manifests and objects written by something
//! other than an honest publisher — duplicates in any order, paths that
//! climb out, keys outside their place, absurd sizes and counts, a manifest
//! under another version's key, truncated, bit-flipped, resized or deleted
//! objects, a delta made for another base, whole prefixes deleted, a lying
//! `latest.json`.
//!
//! Each scenario starts from a bucket (local filesystem) with an anchor (0)
//! and a delta (1), a subscriber following it at 1, then damages version 2
//! (published honestly, or replaced by the damage). The subscriber that
//! follows and one that starts fresh must refuse — or serve an exact earlier
//! version — never anything wrong; the publisher must carry on; and once a
//! good anchor appears both subscribers reach it exactly. Only the
//! subscriber's public behaviour (`catch_up`) is relied on.

use crate::common;

use std::collections::BTreeMap;

use bytes::Bytes;
use serde_json::{Value, json};
use weightcast::protocol::{LATEST_KEY, Manifest, manifest_key, read_manifest};
use weightcast::publisher::Publisher;
use weightcast::store::Store;
use weightcast::subscriber::catch_up;
use weightcast::tensors::TensorSet;

/// An edit of a manifest's JSON.
type Edit = fn(&mut Value, &Manifest);

/// What is done to version 2.
enum Damage {
    /// Edit its manifest's JSON (written back as is, unvalidated).
    Manifest(Edit),
    /// Replace its manifest with these bytes.
    ManifestBytes(Vec<u8>),
    /// Replace its manifest with another version's, as stored.
    ManifestOf(u64),
    /// Edit the bytes of each of its objects under this prefix.
    Objects(&'static str, fn(&mut Vec<u8>)),
    /// Edit the bytes of the anchor objects of version 0 (what a fresh
    /// subscriber bootstraps from).
    Anchor(fn(&mut Vec<u8>)),
    /// Delete its objects under this prefix.
    Delete(&'static str),
    /// Delete every object under this prefix, of every version.
    DeletePrefix(&'static str),
    /// Replace its delta with version 1's delta, and make the manifest's size
    /// and BLAKE3 agree: every byte-level check passes, only the base is wrong.
    ForeignDelta,
    /// Overwrite `latest.json`.
    Latest(&'static [u8]),
}

struct Bucket {
    store: Store,
    _dir: tempfile::TempDir,
    work: tempfile::TempDir,
    publisher: Publisher,
    trainer: common::Trainer,
    /// What each version holds.
    contents: BTreeMap<u64, (TensorSet, Vec<u8>)>,
}

impl Bucket {
    /// Versions 0 (anchor), 1 and 2 (deltas); anchors every 3 versions.
    async fn new(seed: u64) -> Bucket {
        let (store, dir) = common::local_store();
        let work = tempfile::tempdir().unwrap();
        let cfg = common::publisher_config(&work.path().join("state"), 3, None);
        let publisher = Publisher::open(store.clone(), cfg).await.unwrap();
        let mut b = Bucket {
            store,
            _dir: dir,
            work,
            publisher,
            trainer: common::Trainer::new(seed),
            contents: BTreeMap::new(),
        };
        b.publish().await;
        b.publish().await;
        let c = catch_up(&b.store, &b.dir("follower"))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(c.version, 1);
        b.publish().await;
        b
    }

    async fn publish(&mut self) -> u64 {
        if !self.contents.is_empty() {
            self.trainer.step();
        }
        let out = self
            .publisher
            .publish(self.trainer.checkpoint(), &Default::default())
            .await
            .unwrap_or_else(|e| panic!("the publisher did not carry on: {e}"));
        self.contents
            .insert(out.version, (self.trainer.weights(), self.trainer.config()));
        out.version
    }

    fn dir(&self, name: &str) -> std::path::PathBuf {
        self.work.path().join(name)
    }

    async fn manifest(&self, v: u64) -> Manifest {
        read_manifest(&self.store, v).await.unwrap().unwrap()
    }

    async fn put_json(&self, key: &str, v: &Value) {
        let body = serde_json::to_vec(v).unwrap();
        self.store.put(key, Bytes::from(body)).await.unwrap();
    }

    async fn damage(&self, d: &Damage) {
        let m2 = self.manifest(2).await;
        let key2 = manifest_key(2);
        match d {
            Damage::Manifest(edit) => {
                let mut v = serde_json::to_value(&m2).unwrap();
                edit(&mut v, &m2);
                self.put_json(&key2, &v).await;
            }
            Damage::ManifestBytes(b) => {
                self.store.put(&key2, Bytes::from(b.clone())).await.unwrap()
            }
            Damage::ManifestOf(v) => {
                let other = self.store.get(&manifest_key(*v)).await.unwrap().unwrap();
                self.store.put(&key2, other).await.unwrap();
            }
            Damage::Anchor(edit) => {
                for o in self
                    .manifest(0)
                    .await
                    .objects
                    .iter()
                    .filter(|o| o.key.starts_with("anchors/"))
                {
                    let mut b = self.store.get(&o.key).await.unwrap().unwrap().to_vec();
                    edit(&mut b);
                    self.store.put(&o.key, Bytes::from(b)).await.unwrap();
                }
            }
            Damage::Objects(prefix, edit) => {
                for o in m2.objects.iter().filter(|o| o.key.starts_with(prefix)) {
                    let mut b = self.store.get(&o.key).await.unwrap().unwrap().to_vec();
                    edit(&mut b);
                    self.store.put(&o.key, Bytes::from(b)).await.unwrap();
                }
            }
            Damage::Delete(prefix) => {
                for o in m2.objects.iter().filter(|o| o.key.starts_with(prefix)) {
                    self.store.delete(&o.key).await.unwrap();
                }
            }
            Damage::DeletePrefix(prefix) => {
                for l in self.store.list(prefix).await.unwrap() {
                    self.store.delete(&l.key).await.unwrap();
                }
            }
            Damage::ForeignDelta => {
                let m1 = self.manifest(1).await;
                let d1 = m1
                    .objects
                    .iter()
                    .find(|o| o.key.starts_with("deltas/"))
                    .unwrap();
                let bytes = self.store.get(&d1.key).await.unwrap().unwrap();
                let mut v = serde_json::to_value(&m2).unwrap();
                for o in v["objects"].as_array_mut().unwrap() {
                    if o["name"] == d1.name.as_str() && o["role"] == "delta" {
                        self.store
                            .put(o["key"].as_str().unwrap(), bytes.clone())
                            .await
                            .unwrap();
                        o["size"] = json!(d1.size);
                        o["blake3"] = json!(d1.blake3);
                    }
                }
                self.put_json(&key2, &v).await;
            }
            Damage::Latest(b) => self
                .store
                .put(LATEST_KEY, Bytes::from_static(b))
                .await
                .unwrap(),
        }
    }

    /// A catch-up into `out`: on success the replica is exactly the version
    /// reported; on failure exactly `held` (if anything was held).
    async fn check(&self, out: &std::path::Path, held: Option<u64>, what: &str) -> Option<u64> {
        match catch_up(&self.store, out).await {
            Ok(Some(c)) => {
                let (w, cfg) = &self.contents[&c.version];
                common::assert_replica(out, w, cfg, &format!("{what}: served {}", c.version));
                Some(c.version)
            }
            Ok(None) => {
                // The bucket looks empty (every manifest deleted): nothing
                // changes here.
                if let Some(v) = held {
                    let (w, cfg) = &self.contents[&v];
                    common::assert_replica(out, w, cfg, &format!("{what}: kept {v} (empty)"));
                }
                held
            }
            Err(e) => {
                eprintln!("{what}: refused: {e}");
                assert!(!e.to_string().is_empty());
                if let Some(v) = held {
                    let (w, cfg) = &self.contents[&v];
                    common::assert_replica(out, w, cfg, &format!("{what}: kept {v} ({e})"));
                }
                held
            }
        }
    }
}

/// One scenario: damage version 2; the follower (at 1) and a fresh subscriber
/// serve nothing wrong; the publisher carries on to the next anchor; both
/// subscribers reach it exactly.
async fn scenario(name: &str, d: Damage, seed: u64) {
    let mut b = Bucket::new(seed).await;
    let (follower, fresh) = (b.dir("follower"), b.dir("fresh"));
    b.damage(&d).await;
    let mut held = b
        .check(&follower, Some(1), &format!("{name} (follower)"))
        .await;
    b.check(&fresh, None, &format!("{name} (fresh)")).await;
    // On to a good anchor: the next version after 2 is one (every 3, or
    // because the publisher could not build on a damaged manifest).
    let mut newest = b.publish().await;
    while b.manifest(newest).await.kind != weightcast::protocol::VersionKind::Anchor {
        held = b
            .check(&follower, held, &format!("{name} (follower at {newest})"))
            .await;
        newest = b.publish().await;
    }
    for (out, who) in [(&follower, "follower"), (&fresh, "fresh")] {
        let got = b
            .check(out, None, &format!("{name} ({who}, after anchor {newest})"))
            .await;
        assert_eq!(got, Some(newest), "{name}: {who} did not recover");
    }
}

fn objects(v: &mut Value) -> &mut Vec<Value> {
    v["objects"].as_array_mut().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_manifests_are_refused_and_the_next_anchor_recovers() {
    let edits: Vec<(&str, Edit)> = vec![
        ("an object listed twice", |v, _| {
            let o = objects(v)[0].clone();
            objects(v).push(o);
        }),
        ("an object listed twice, the copy first", |v, _| {
            let o = objects(v).last().unwrap().clone();
            objects(v).insert(0, o);
        }),
        ("a tensor file also listed as a file object", |v, m| {
            let key = format!("files/00000000000000000002-{}/model.safetensors", m.writer);
            objects(v).insert(
                0,
                json!({"name": "model.safetensors", "role": "file",
                "key": key, "size": 3, "blake3": "0".repeat(64)}),
            );
        }),
        ("a name that climbs out", |v, m| {
            let o = &mut objects(v)[0];
            o["name"] = json!("../../escape.safetensors");
            o["key"] = json!(format!(
                "deltas/00000000000000000002-{}/../../escape.safetensors",
                m.writer
            ));
        }),
        ("an absolute name", |v, _| {
            objects(v)[0]["name"] = json!("/etc/model.safetensors")
        }),
        ("a key at another version's place", |v, m| {
            let k = m.objects[0]
                .key
                .replace("00000000000000000002-", "00000000000000000001-");
            objects(v)[0]["key"] = json!(k);
        }),
        ("a key outside the object prefixes", |v, _| {
            objects(v)[0]["key"] = json!("versions/00000000000000000001.json")
        }),
        ("an absurd size", |v, _| {
            objects(v)[0]["size"] = json!(u64::MAX)
        }),
        ("a size of zero", |v, _| objects(v)[0]["size"] = json!(0)),
        ("50,000 objects", |v, m| {
            for i in 0..50_000 {
                let name = format!("shard-{i}.safetensors");
                let key = format!("deltas/00000000000000000002-{}/{name}", m.writer);
                objects(v).push(json!({"name": name, "role": "delta", "key": key,
                    "size": 1, "blake3": "0".repeat(64)}));
            }
        }),
        ("50,000 listed files", |v, _| {
            let files = v["files"].as_array_mut().unwrap();
            for i in 0..50_000 {
                files.push(
                    json!({"name": format!("f{i}.json"), "size": 1, "blake3": "0".repeat(64)}),
                );
            }
        }),
        ("a delta claiming to be an anchor", |v, _| {
            v["kind"] = json!("anchor");
            v["anchor_version"] = json!(2);
        }),
        ("a base version with a gap", |v, _| {
            v["base_version"] = json!(0)
        }),
        ("an anchor version in the future", |v, _| {
            v["anchor_version"] = json!(9)
        }),
        ("an unknown format", |v, _| {
            v["format"] = json!("weightcast-manifest/9")
        }),
        ("an unknown field", |v, _| v["extra"] = json!(1)),
        ("a manifest of version 5 under version 2's key", |v, _| {
            v["version"] = json!(5)
        }),
        ("a negative size", |v, _| objects(v)[0]["size"] = json!(-1)),
    ];
    for (i, (name, edit)) in edits.into_iter().enumerate() {
        scenario(name, Damage::Manifest(edit), 100 + i as u64).await;
    }
    let honest = serde_json::to_vec(&Bucket::new(1).await.manifest(2).await).unwrap();
    let bytes: Vec<(&str, Vec<u8>)> = vec![
        ("a manifest that is not JSON", b"\x00\xffnot json".to_vec()),
        ("an empty manifest", Vec::new()),
        ("a truncated manifest", honest[..honest.len() / 2].to_vec()),
        ("a 17 MiB manifest", vec![b' '; 17 << 20]),
        (
            "JSON nested 100,000 deep",
            [vec![b'['; 100_000], vec![b']'; 100_000]].concat(),
        ),
    ];
    for (i, (name, b)) in bytes.into_iter().enumerate() {
        scenario(name, Damage::ManifestBytes(b), 200 + i as u64).await;
    }
}

/// A whole, valid manifest of another version stored under version 2's key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_manifest_stored_under_another_versions_key_is_refused() {
    scenario(
        "version 1's manifest under version 2's key",
        Damage::ManifestOf(1),
        300,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn damaged_or_missing_objects_are_refused_and_the_next_anchor_recovers() {
    let cases: Vec<(&str, Damage)> = vec![
        (
            "a truncated delta",
            Damage::Objects("deltas/", |b| b.truncate(b.len() / 2)),
        ),
        (
            "a bit-flipped delta",
            Damage::Objects("deltas/", |b| {
                let i = b.len() - 3;
                b[i] ^= 0x04;
            }),
        ),
        (
            "a bit flipped in a delta's header",
            Damage::Objects("deltas/", |b| b[20] ^= 0x01),
        ),
        (
            "a delta grown by one byte",
            Damage::Objects("deltas/", |b| b.push(0)),
        ),
        ("an emptied delta", Damage::Objects("deltas/", Vec::clear)),
        (
            "a truncated file object",
            Damage::Objects("files/", |b| b.truncate(1)),
        ),
        (
            "a bit-flipped file object",
            Damage::Objects("files/", |b| b[0] ^= 0x20),
        ),
        ("a deleted delta", Damage::Delete("deltas/")),
        ("a deleted file object", Damage::Delete("files/")),
        ("every delta deleted", Damage::DeletePrefix("deltas")),
        ("every file object deleted", Damage::DeletePrefix("files")),
        ("every anchor deleted", Damage::DeletePrefix("anchors")),
        ("every manifest deleted", Damage::DeletePrefix("versions")),
        ("a delta made for another base", Damage::ForeignDelta),
        (
            "a truncated anchor",
            Damage::Anchor(|b| b.truncate(b.len() - 1)),
        ),
        (
            "a bit-flipped anchor",
            Damage::Anchor(|b| {
                let i = b.len() / 2;
                b[i] ^= 0x80;
            }),
        ),
        (
            "an anchor's header rewritten",
            Damage::Anchor(|b| b[10] = b'!'),
        ),
    ];
    for (i, (name, d)) in cases.into_iter().enumerate() {
        scenario(name, d, 400 + i as u64).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lying_latest_hint_is_harmless() {
    let cases: Vec<(&str, &'static [u8])> = vec![
        ("latest.json not JSON", b"\xff\xfe"),
        (
            "latest.json far ahead",
            br#"{"version": 1000000000000, "anchor_version": 999999999999}"#,
        ),
        (
            "latest.json at the last version",
            br#"{"version": 18446744073709551615, "anchor_version": 18446744073709551615}"#,
        ),
        (
            "latest.json behind",
            br#"{"version": 0, "anchor_version": 0}"#,
        ),
    ];
    for (i, (name, b)) in cases.into_iter().enumerate() {
        scenario(name, Damage::Latest(b), 500 + i as u64).await;
    }
    // Oversized: refused from its size, before its body is read.
    let b = Bucket::new(510).await;
    b.store
        .put(LATEST_KEY, Bytes::from(vec![b' '; 1 << 20]))
        .await
        .unwrap();
    assert!(
        weightcast::protocol::read_latest(&b.store, None)
            .await
            .is_err()
    );
}

/// A manifest at the last possible version (`versions/18446744073709551615.json`):
/// the publisher refuses by name, without a panic or a wrapped-around number.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_manifest_at_the_last_possible_version_stops_the_publisher_cleanly() {
    let mut b = Bucket::new(600).await;
    let mut m = serde_json::to_value(b.manifest(0).await).unwrap();
    m["version"] = json!(u64::MAX);
    m["anchor_version"] = json!(u64::MAX);
    b.put_json(&manifest_key(u64::MAX), &m).await;
    b.trainer.step();
    let e = b
        .publisher
        .publish(b.trainer.checkpoint(), &Default::default())
        .await
        .expect_err("published after the last possible version");
    assert!(e.to_string().contains(&manifest_key(u64::MAX)), "{e}");
    assert_eq!(e.kind(), weightcast::error::ErrorKind::Corrupt);
    // Removed, the publisher carries on.
    b.store.delete(&manifest_key(u64::MAX)).await.unwrap();
    b.publish().await;
}

/// The same manifest seen by subscribers: they must refuse it (or ignore it)
/// without a panic, and keep serving exactly what they held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_manifest_at_the_last_possible_version_is_refused_by_subscribers() {
    let b = Bucket::new(601).await;
    let mut m = serde_json::to_value(b.manifest(2).await).unwrap();
    m["version"] = json!(u64::MAX);
    m["base_version"] = json!(u64::MAX - 1);
    b.put_json(&manifest_key(u64::MAX), &m).await;
    let follower = b.dir("follower");
    let run = {
        let (store, follower) = (b.store.clone(), follower.clone());
        tokio::spawn(async move {
            catch_up(&store, &follower)
                .await
                .map(|c| c.map(|c| c.version))
        })
    };
    let outcome = run.await;
    assert!(outcome.is_ok(), "the subscriber panicked: {outcome:?}");
    b.check(&follower, Some(1), "the last possible version")
        .await;
    b.check(&b.dir("fresh"), None, "the last possible version (fresh)")
        .await;
}

/// A corrupt newest version is quarantined, not served: a follower keeps its
/// verified version, a fresh subscriber materializes the newest version it
/// can verify, both report the bad one (catch-up result, registration), and
/// the next good anchor moves both on with the quarantine cleared.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_newest_version_is_quarantined_and_the_fleet_serves_the_last_good_one() {
    let mut b = Bucket::new(41).await;
    b.damage(&Damage::Objects("deltas/", |bytes| {
        let n = bytes.len();
        bytes[n - 3] ^= 0x40;
    }))
    .await;
    let (follower, fresh) = (b.dir("follower"), b.dir("fresh"));
    for (out, who) in [(&follower, "follower"), (&fresh, "fresh")] {
        let mut cfg = weightcast::subscriber::DaemonConfig::new(out);
        cfg.id = Some(who.to_string());
        let (c, _) = weightcast::subscriber::once(&b.store, &cfg)
            .await
            .unwrap_or_else(|e| panic!("{who}: a bad newest version stalled it: {e}"))
            .expect("a version");
        assert_eq!(c.version, 1, "{who} serves the last verifiable version");
        let (w, config) = &b.contents[&1];
        common::assert_replica(out, w, config, who);
        let q: Vec<u64> = c.quarantined.iter().map(|q| q.version).collect();
        assert_eq!(q, vec![2], "{who} reports the bad version");
        assert!(
            c.quarantined[0].error.contains("deltas/"),
            "the reason names the object: {:?}",
            c.quarantined[0]
        );
    }
    let regs = weightcast::protocol::registrations(&b.store).await.unwrap();
    assert_eq!(regs.len(), 2);
    for r in &regs {
        assert_eq!(
            (r.version, r.quarantined.clone()),
            (Some(1), vec![2]),
            "{r:?}"
        );
    }
    // The next version is an anchor (every 3): both reach it, nothing quarantined.
    let v = b.publish().await;
    assert_eq!(v, 3);
    for (out, who) in [(&follower, "follower"), (&fresh, "fresh")] {
        let c = catch_up(&b.store, out).await.unwrap().unwrap();
        assert_eq!(c.version, 3, "{who}");
        assert!(c.quarantined.is_empty(), "{who}: {:?}", c.quarantined);
        let (w, config) = &b.contents[&3];
        common::assert_replica(out, w, config, who);
    }
}
