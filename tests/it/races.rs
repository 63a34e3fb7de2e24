//! Races on a real S3 server (moto): two publishers on one prefix, and
//! garbage collection running while a publisher commits and subscribers
//! catch up. Nothing wrong is served, nothing committed is lost, and every
//! party recovers by itself.

use crate::common;

use std::collections::BTreeMap;

use weightcast::protocol::{Retention, collect_garbage, read_manifest, versions_after};
use weightcast::publisher::{Published, Publisher};
use weightcast::store::Store;
use weightcast::subscriber::catch_up;
use weightcast::tensors::TensorSet;

/// What a version holds: the weights and `config.json` of the trainer whose
/// publisher committed it.
type Contents = BTreeMap<u64, (TensorSet, Vec<u8>)>;

fn record(contents: &mut Contents, out: &weightcast::Result<Published>, t: &common::Trainer) {
    if let Ok(p) = out
        && !p.unchanged
    {
        let previous = contents.insert(p.version, (t.weights(), t.config()));
        assert!(previous.is_none(), "version {} reported twice", p.version);
    }
}

/// Two publishers with their own trainers and state race every round. Each
/// version is committed by exactly one of them (the store's create-if-absent
/// decides), a loser resyncs and continues — its next publish succeeds — and
/// a subscriber following along always holds exactly what the committer of
/// the version it reports published.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_publishers_on_one_prefix_commit_each_version_once() {
    let store = common::moto_store("races-two", "run").await;
    let work = tempfile::tempdir().unwrap();
    let open = |name: &str| {
        Publisher::open(
            store.clone(),
            common::publisher_config(&work.path().join(name), 3, None),
        )
    };
    let (mut a, mut b) = (open("a").await.unwrap(), open("b").await.unwrap());
    let (mut ta, mut tb) = (common::Trainer::new(41), common::Trainer::new(42));
    let mut contents = Contents::new();
    let (mut conflicts, mut reported) = (0, 0);
    let sub = work.path().join("sub");
    let opts = Default::default();
    for _ in 0..common::scaled(6, 40) {
        ta.step();
        tb.step();
        let (ra, rb) = tokio::join!(
            a.publish(ta.checkpoint(), &opts),
            b.publish(tb.checkpoint(), &opts)
        );
        for r in [&ra, &rb] {
            match r {
                Ok(p) if !p.unchanged => reported += 1,
                Ok(_) => {}
                // Lost the race twice in a row: refused, nothing half-done.
                Err(weightcast::Error::Conflict(why)) => {
                    assert!(why.contains("another publisher"), "{why}");
                    conflicts += 1;
                }
                Err(e) => panic!("publish failed: {e}"),
            }
        }
        record(&mut contents, &ra, &ta);
        record(&mut contents, &rb, &tb);
        let c = catch_up(&store, &sub).await.unwrap().unwrap();
        let (w, cfg) = &contents[&c.version];
        common::assert_replica(&sub, w, cfg, &format!("version {}", c.version));
    }
    // Every reported commit is in the bucket, and nothing else is.
    let versions = versions_after(&store, None).await.unwrap();
    assert_eq!(versions, contents.keys().copied().collect::<Vec<_>>());
    assert_eq!(versions.len(), reported);
    // Both committed some versions; whoever lost a race continued.
    let writers: std::collections::BTreeSet<String> =
        futures::future::join_all(versions.iter().map(|&v| read_manifest(&store, v)))
            .await
            .into_iter()
            .map(|m| m.unwrap().unwrap().writer)
            .collect();
    assert!(writers.len() >= 2, "one publisher never committed");
    assert!(conflicts <= 2 * common::scaled(6, 40));
    // A late joiner ends at the newest version, exactly.
    let late = work.path().join("late");
    let c = catch_up(&store, &late).await.unwrap().unwrap();
    assert_eq!(Some(&c.version), versions.last());
    let (w, cfg) = &contents[&c.version];
    common::assert_replica(&late, w, cfg, "late joiner");
}

/// On a store that ignores conditional writes (Garage 2.5) two publishers
/// could both "win" a version: each is refused at startup without
/// `--single-writer`.
#[tokio::test]
async fn publishers_on_a_store_without_conditional_writes_are_refused() {
    let g = common::garage();
    let o = common::garage_options();
    let opts: Vec<(&str, &str)> = o.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let store = Store::open_with(&format!("s3://{}/races", g.bucket), &opts).unwrap();
    let work = tempfile::tempdir().unwrap();
    for name in ["a", "b"] {
        let cfg = common::publisher_config(&work.path().join(name), 3, None);
        match Publisher::open(store.clone(), cfg).await {
            Err(e) => assert!(e.to_string().contains("--single-writer"), "{e}"),
            Ok(_) => panic!("publisher {name} opened a store without conditional writes"),
        }
    }
}

/// Garbage collection (a `gc` loop keeping one anchor, plus the publisher's
/// own retention after each anchor) runs while a publisher commits and two
/// subscribers catch up — one following, one starting fresh each time.
/// Every publish succeeds; a subscriber may fail while a version it reads is
/// collected, but then still serves the version it held, exactly; with gc
/// stopped both converge; and every manifest left has all its objects.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gc_concurrent_with_publish_and_subscribe_deletes_nothing_in_use() {
    let store = common::moto_store("races-gc", "run").await;
    let work = tempfile::tempdir().unwrap();
    let keep = Retention {
        keep_anchors: 1,
        registration_max_age_s: None,
    };
    let mut cfg = common::publisher_config(&work.path().join("state"), 2, None);
    cfg.retention = Some(keep.clone());
    let mut p = Publisher::open(store.clone(), cfg).await.unwrap();
    let mut t = common::Trainer::new(43);
    let contents = std::sync::Mutex::new(Contents::new());
    let done = std::sync::atomic::AtomicBool::new(false);
    let rounds = common::scaled(12, 80);

    let publishing = async {
        for i in 0..rounds {
            if i > 0 {
                t.step();
            }
            let out = p.publish(t.checkpoint(), &Default::default()).await;
            let out = out.unwrap_or_else(|e| panic!("publish {i} failed under gc: {e}"));
            record(&mut contents.lock().unwrap(), &Ok(out), &t);
        }
        done.store(true, std::sync::atomic::Ordering::SeqCst);
    };
    let collecting = async {
        let (mut runs, mut removed) = (0, 0);
        while !done.load(std::sync::atomic::Ordering::SeqCst) {
            removed += collect_garbage(&store, &keep, false)
                .await
                .unwrap()
                .versions
                .len();
            runs += 1;
        }
        (runs, removed)
    };
    // What version `v` holds (a subscriber can see a commit before the
    // publisher's call returns and records it).
    let contents_of = |v: u64| {
        let contents = &contents;
        async move {
            for _ in 0..200 {
                if let Some(c) = contents.lock().unwrap().get(&v) {
                    return c.clone();
                }
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            }
            panic!("version {v} was served but never reported by the publisher");
        }
    };
    let subscribing = |name: &'static str, fresh: bool| {
        let (store, contents_of, done, dir) = (&store, &contents_of, &done, work.path());
        async move {
            let (mut served, mut failed) = (0, 0);
            let mut held: Option<u64> = None;
            let mut i = 0;
            while !done.load(std::sync::atomic::Ordering::SeqCst) {
                i += 1;
                let out = if fresh {
                    dir.join(format!("{name}-{i}"))
                } else {
                    dir.join(name)
                };
                match catch_up(store, &out).await {
                    Ok(Some(c)) => {
                        served += 1;
                        let (w, cfg) = contents_of(c.version).await;
                        common::assert_replica(&out, &w, &cfg, &format!("{name} at {}", c.version));
                        held = Some(c.version);
                    }
                    Ok(None) => {}
                    Err(_) => {
                        failed += 1;
                        if let (false, Some(v)) = (fresh, held) {
                            let (w, cfg) = contents_of(v).await;
                            common::assert_replica(&out, &w, &cfg, &format!("{name} kept {v}"));
                        }
                    }
                }
                if fresh {
                    let _ = std::fs::remove_dir_all(&out);
                }
            }
            (served, failed)
        }
    };
    let ((), (gc_runs, removed), followed, fresh) = tokio::join!(
        publishing,
        collecting,
        subscribing("follower", false),
        subscribing("fresh", true)
    );
    eprintln!(
        "gc: {gc_runs} runs removed {removed} versions; follower served {} failed {}; \
         fresh served {} failed {}",
        followed.0, followed.1, fresh.0, fresh.1
    );
    assert!(gc_runs > 0 && removed > 0 && followed.0 > 0 && fresh.0 > 0);

    // Quiet again: every manifest left names objects that all exist.
    let listed: std::collections::HashMap<String, u64> =
        futures::future::join_all(["anchors", "deltas", "files"].map(|p| store.list(p)))
            .await
            .into_iter()
            .flat_map(|l| l.unwrap())
            .map(|l| (l.key, l.size))
            .collect();
    let versions = versions_after(&store, None).await.unwrap();
    assert!(!versions.is_empty());
    for v in &versions {
        let m = read_manifest(&store, *v).await.unwrap().unwrap();
        for o in &m.objects {
            assert_eq!(
                listed.get(&o.key),
                Some(&o.size),
                "v{v}: {} collected",
                o.key
            );
        }
    }
    let contents = contents.into_inner().unwrap();
    let newest = *contents.keys().last().unwrap();
    assert_eq!(versions.last(), Some(&newest));
    for name in ["follower", "late"] {
        let out = work.path().join(name);
        let c = catch_up(&store, &out).await.unwrap().unwrap();
        assert_eq!(c.version, newest, "{name}");
        let (w, cfg) = &contents[&newest];
        common::assert_replica(&out, w, cfg, name);
    }
}
