//! Local resources running out under a subscriber: the disk filling up (a
//! small tmpfs; mounting it needs root, as CI runs) and file descriptors
//! (`ulimit -n` on the CLI). Each must fail cleanly — an I/O error naming
//! what failed, no panic — keep `current` at its verified version, and
//! recover without a human once the resource is back.

use crate::common;

use weightcast::publisher::Publisher;
use weightcast::subscriber::catch_up;

/// A tmpfs of `bytes` mounted at a fresh directory; unmounted on drop.
struct Tmpfs(tempfile::TempDir);

impl Tmpfs {
    fn mount(bytes: u64) -> Tmpfs {
        let dir = tempfile::tempdir().unwrap();
        let out = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={bytes}")])
            .arg("tmpfs")
            .arg(dir.path())
            .output()
            .expect("running mount");
        assert!(
            out.status.success(),
            "the disk-full test mounts a small tmpfs and needs root (CI runs as root): {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Tmpfs(dir)
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg(self.0.path())
            .status();
    }
}

/// Fills the filesystem at `dir` with one file until it is full.
fn fill(dir: &std::path::Path) -> std::path::PathBuf {
    use std::io::Write;
    let path = dir.join("filler");
    let mut f = std::fs::File::create(&path).unwrap();
    let chunk = vec![0xa5u8; 4096];
    while f.write_all(&chunk).is_ok() {}
    let _ = f.sync_all();
    path
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_disk_fails_the_catch_up_cleanly_and_it_recovers() {
    let (store, _bucket) = common::local_store();
    let work = tempfile::tempdir().unwrap();
    let cfg = common::publisher_config(&work.path().join("state"), 3, None);
    let mut p = Publisher::open(store.clone(), cfg).await.unwrap();
    let mut t = common::Trainer::new(17);
    p.publish(t.checkpoint(), &Default::default())
        .await
        .unwrap();
    let disk = Tmpfs::mount(4 << 20);
    let out = disk.0.path().join("out");
    let c = catch_up(&store, &out).await.unwrap().unwrap();
    common::assert_replica(&out, &t.weights(), &t.config(), "before");
    let mut held = (c.version, t.weights(), t.config());
    let filler = fill(disk.0.path());
    let mut failed = 0;
    for v in 1..=4u64 {
        t.step();
        let published = p
            .publish(t.checkpoint(), &Default::default())
            .await
            .unwrap();
        assert_eq!(published.version, v);
        match catch_up(&store, &out).await {
            Ok(Some(c)) => {
                assert_eq!(c.version, v, "{c:?}");
                common::assert_replica(&out, &t.weights(), &t.config(), "disk full, succeeded");
                held = (c.version, t.weights(), t.config());
            }
            Ok(None) => panic!("the bucket has versions"),
            Err(e) => {
                failed += 1;
                assert_eq!(e.kind(), weightcast::error::ErrorKind::Io, "{e}");
                assert!(e.to_string().to_lowercase().contains("space"), "{e}");
                common::assert_replica(&out, &held.1, &held.2, &format!("disk full at {v}: {e}"));
            }
        }
    }
    assert!(
        failed > 0,
        "the full disk never got in the way: the test proves nothing"
    );
    std::fs::remove_file(filler).unwrap();
    let c = catch_up(&store, &out).await.unwrap().unwrap();
    assert_eq!(c.version, 4);
    common::assert_replica(&out, &t.weights(), &t.config(), "space is back");
    assert!(held.0 < 4);
}

/// A slot file that may share its blocks (a reflinked clone, as on XFS or
/// Btrfs; here `WEIGHTCAST_ROOM_CHECK=always` on a tmpfs, which has no
/// reflinks) is not rewritten in place without its size free: a shared
/// block written on a full disk raises SIGBUS. The catch-up fails naming the
/// file, keeps its version, and goes through once there is room. Without
/// the check the same catch-up succeeds (tmpfs copies own their pages), so
/// the refusal is the check's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shared_slot_is_not_rewritten_without_room() {
    let (store, bucket) = common::local_store();
    let work = tempfile::tempdir().unwrap();
    let cfg = common::publisher_config(&work.path().join("state"), 3, None);
    let mut p = Publisher::open(store.clone(), cfg).await.unwrap();
    let mut t = common::Trainer::new(29);
    p.publish(t.checkpoint(), &Default::default())
        .await
        .unwrap();
    let disk = Tmpfs::mount(8 << 20);
    let out = disk.0.path().join("out");
    let url = url::Url::from_directory_path(bucket.path()).unwrap();
    let subscribe = |check: &str| {
        std::process::Command::new(env!("CARGO_BIN_EXE_weightcast"))
            .args(["subscribe", "--once", "--quiet", "--store", url.as_str()])
            .arg("--out")
            .arg(&out)
            .env("WEIGHTCAST_ROOM_CHECK", check)
            .output()
            .unwrap()
    };
    let o = subscribe("always");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let held = (t.weights(), t.config());
    // Full but for half a slot file: room for a delta's objects and the
    // state, not for a whole file's blocks.
    let model = std::fs::read_dir(out.join("slots"))
        .unwrap()
        .flatten()
        .map(|d| d.path().join("model.safetensors"))
        .find(|p| p.exists())
        .expect("a slot with the model");
    let size = std::fs::metadata(&model).unwrap().len();
    let filler = fill(disk.0.path());
    let full = std::fs::metadata(&filler).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&filler)
        .unwrap()
        .set_len(full.saturating_sub(size / 2))
        .unwrap();
    t.step();
    p.publish(t.checkpoint(), &Default::default())
        .await
        .unwrap();
    let o = subscribe("always");
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "a full disk and the check: {stderr}");
    assert!(stderr.contains("bytes are free"), "{stderr}");
    assert!(stderr.contains("in place"), "{stderr}");
    common::assert_replica(&out, &held.0, &held.1, "refused");
    let o = subscribe("never");
    assert!(
        o.status.success(),
        "without the check the delta fits in place: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    common::assert_replica(&out, &t.weights(), &t.config(), "unchecked");
    t.step();
    p.publish(t.checkpoint(), &Default::default())
        .await
        .unwrap();
    std::fs::remove_file(filler).unwrap();
    let o = subscribe("always");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    common::assert_replica(&out, &t.weights(), &t.config(), "room is back");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn running_out_of_file_descriptors_fails_cleanly_and_it_recovers() {
    let (store, bucket) = common::local_store();
    let work = tempfile::tempdir().unwrap();
    let cfg = common::publisher_config(&work.path().join("state"), 3, None);
    let mut p = Publisher::open(store.clone(), cfg).await.unwrap();
    let mut t = common::Trainer::new(23);
    p.publish(t.checkpoint(), &Default::default())
        .await
        .unwrap();
    let out = work.path().join("out");
    let url = url::Url::from_directory_path(bucket.path()).unwrap();
    let subscribe = |limit: Option<u32>| {
        let bin = env!("CARGO_BIN_EXE_weightcast");
        let ulimit = limit.map_or(String::new(), |n| format!("ulimit -n {n}; "));
        std::process::Command::new("bash")
            .arg("-c")
            .arg(format!(
                "{ulimit}exec '{bin}' subscribe --once --quiet --store '{url}' --out '{}'",
                out.display()
            ))
            .output()
            .unwrap()
    };
    let o = subscribe(None);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let mut held = (t.weights(), t.config());
    let mut failed = 0;
    for limit in [6, 16, 48, 64, 72, 96] {
        t.step();
        p.publish(t.checkpoint(), &Default::default())
            .await
            .unwrap();
        let o = subscribe(Some(limit));
        let stderr = String::from_utf8_lossy(&o.stderr);
        if o.status.success() {
            common::assert_replica(&out, &t.weights(), &t.config(), &format!("ulimit {limit}"));
            held = (t.weights(), t.config());
        } else {
            failed += 1;
            // A clean failure: an exit code of ours, not a panic (101) or a signal.
            let code = o.status.code();
            assert!(
                code.is_some_and(|c| c != 101 && c != 0),
                "ulimit -n {limit}: {:?}\n{stderr}",
                o.status
            );
            assert!(!stderr.contains("panicked"), "ulimit -n {limit}: {stderr}");
            assert!(
                stderr.contains("ulimit -n")
                    || stderr.to_lowercase().contains("too many open files"),
                "ulimit -n {limit}: the error names the limit: {stderr}"
            );
            if out.join("current").exists() {
                common::assert_replica(
                    &out,
                    &held.0,
                    &held.1,
                    &format!("ulimit {limit}: {stderr}"),
                );
            }
        }
    }
    assert!(
        failed > 0,
        "no limit got in the way: the test proves nothing"
    );
    // A soft limit it can raise, but only to a hard limit still too low:
    // refused at start too.
    let o = std::process::Command::new("bash")
        .arg("-c")
        .arg(format!(
            "ulimit -Sn 16; ulimit -Hn 48; exec '{}' subscribe --once --quiet --store '{url}' --out '{}'",
            env!("CARGO_BIN_EXE_weightcast"),
            out.display()
        ))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(78), "{stderr}");
    assert!(
        stderr.contains("ulimit -n") && stderr.contains("is 48"),
        "{stderr}"
    );
    let o = subscribe(None);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    common::assert_replica(&out, &t.weights(), &t.config(), "descriptors back");
}
