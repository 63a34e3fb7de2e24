//! The publisher killed at every phase of a commit (failpoints in the real
//! binary: the process aborts as `kill -9` would stop it), then restarted:
//! it continues without human help, never publishes a wrong delta, and a
//! subscriber ends bit-identical to the last checkpoint.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

use weightcast::generator::{Generator, GeneratorConfig};
use weightcast::tensors::{Digests, TensorSet};

fn publish(
    url: &str,
    state: &Path,
    ckpt: &Path,
    failpoint: Option<&str>,
) -> Option<serde_json::Value> {
    publish_in(url, state, ckpt, failpoint, "auto")
}

/// `publish` with `--state-mode mode`.
fn publish_in(
    url: &str,
    state: &Path,
    ckpt: &Path,
    failpoint: Option<&str>,
    mode: &str,
) -> Option<serde_json::Value> {
    let mut c = crate::common::publish_command(url, state, ckpt, failpoint);
    c.args(["--state-mode", mode]);
    let out = c.output().expect("running weightcast publish");
    if failpoint.is_some() {
        assert!(
            !out.status.success(),
            "{failpoint:?} did not stop the process"
        );
        return None;
    }
    assert!(
        out.status.success(),
        "publish failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Some(serde_json::from_slice(&out.stdout).expect("one JSON line"))
}

fn checkpoint(g: &Generator, dir: &Path) -> std::path::PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    let f = dir.join("model.safetensors");
    g.snapshot()
        .write_to(&BTreeMap::new(), &mut std::fs::File::create(&f).unwrap())
        .unwrap();
    std::fs::write(dir.join("config.json"), b"{\"v\":1}").unwrap();
    f.parent().unwrap().to_path_buf()
}

#[test]
#[cfg_attr(
    not(feature = "failpoints"),
    ignore = "needs --features failpoints (scripts/test.sh enables it)"
)]
fn a_publisher_killed_at_any_commit_phase_recovers() {
    // Every way of keeping the snapshot: patched in place, the anchor's
    // files with the deltas since beside them (the overlay), or none (the
    // previous checkpoint as the base).
    for (mode, point) in ["in-place", "overlay", "previous"]
        .into_iter()
        .flat_map(|m| {
            [
                "publisher.before_commit",
                "publisher.after_commit",
                "publisher.after_latest",
                "publisher.before_record",
            ]
            .map(|p| (m, p))
        })
    {
        // Versions 0..=4 with anchors at 0 and 3: the crash hits version 2 (a
        // delta) in one run and version 3 (an anchor with bridges) in the next.
        for crash_at in [2u64, 3] {
            let work = tempfile::tempdir().unwrap();
            let bucket = work.path().join("bucket");
            let url = url::Url::from_directory_path(&bucket).unwrap().to_string();
            std::fs::create_dir_all(&bucket).unwrap();
            let state = work.path().join("state");
            let mut g = Generator::new(GeneratorConfig::tiny(11));
            let mut last = None;
            for v in 0..=4u64 {
                if v > 0 {
                    g.step();
                }
                let ckpt = checkpoint(&g, &work.path().join(format!("ckpt-{v}")));
                if v == crash_at {
                    publish_in(&url, &state, &ckpt, Some(point), mode);
                }
                let out = publish_in(&url, &state, &ckpt, None, mode).unwrap();
                let committed_before = point != "publisher.before_commit" && v == crash_at;
                // Committed by the crashed run: the rerun finds the same
                // content and answers that version; otherwise it commits it.
                assert_eq!(out["version"], v, "{mode} {point} at {crash_at}: {out}");
                assert_eq!(
                    out["unchanged"].as_bool().unwrap_or(false),
                    committed_before,
                    "{point} at {crash_at}: {out}"
                );
                if !committed_before {
                    let want = if v % 3 == 0 { "anchor" } else { "delta" };
                    assert_eq!(
                        out["kind"], want,
                        "{mode} {point} at {crash_at}, v{v}: {out}"
                    );
                }
                last = Some(ckpt);
            }
            // The version after the crash was a delta (or the policy's
            // anchor): the snapshot stayed trusted. A fresh subscriber holds
            // exactly the last checkpoint.
            let sub = work.path().join("sub");
            let rt = tokio::runtime::Runtime::new().unwrap();
            let store = weightcast::store::Store::open(&url).unwrap();
            let c = rt
                .block_on(weightcast::subscriber::catch_up(&store, &sub))
                .unwrap()
                .unwrap();
            assert_eq!(c.version, 4);
            let want = TensorSet::read(&last.unwrap().join("model.safetensors"), Digests::Compute)
                .unwrap();
            let got =
                TensorSet::read(&sub.join("current/model.safetensors"), Digests::Compute).unwrap();
            assert_eq!(got.digest(), want.digest(), "{point} at {crash_at}");
            for (i, t) in want.tensors().iter().enumerate() {
                let j = got.position(&t.name).unwrap();
                assert_eq!(
                    got.data(j),
                    want.data(i),
                    "{point} at {crash_at}: {}",
                    t.name
                );
            }
        }
    }
}

/// D1: a publisher whose bucket was wiped does not write deltas onto versions
/// that no longer exist: it publishes an anchor, numbered after what it had,
/// that a fresh subscriber replicates exactly.
#[test]
fn a_wiped_bucket_gets_an_anchor() {
    let work = tempfile::tempdir().unwrap();
    let bucket = work.path().join("bucket");
    std::fs::create_dir_all(&bucket).unwrap();
    let url = url::Url::from_directory_path(&bucket).unwrap().to_string();
    let state = work.path().join("state");
    let mut g = Generator::new(GeneratorConfig::tiny(12));
    for v in 0..2u64 {
        if v > 0 {
            g.step();
        }
        let ckpt = checkpoint(&g, &work.path().join(format!("ckpt-{v}")));
        assert_eq!(publish(&url, &state, &ckpt, None).unwrap()["version"], v);
    }
    for e in std::fs::read_dir(&bucket).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            std::fs::remove_dir_all(p).unwrap();
        } else {
            std::fs::remove_file(p).unwrap();
        }
    }
    g.step();
    let ckpt = checkpoint(&g, &work.path().join("ckpt-2"));
    let out = publish(&url, &state, &ckpt, None).unwrap();
    assert_eq!(
        (out["version"].as_u64(), out["kind"].as_str()),
        (Some(2), Some("anchor"))
    );
    let store = weightcast::store::Store::open(&url).unwrap();
    let sub = work.path().join("sub");
    let rt = tokio::runtime::Runtime::new().unwrap();
    let c = rt
        .block_on(weightcast::subscriber::catch_up(&store, &sub))
        .unwrap()
        .unwrap();
    assert_eq!(c.version, 2);
    let want = TensorSet::read(&ckpt.join("model.safetensors"), Digests::Compute).unwrap();
    let got = TensorSet::read(&sub.join("current/model.safetensors"), Digests::Compute).unwrap();
    assert_eq!(got.digest(), want.digest());
}

/// D6: a reader that closed stdout does not turn a successful commit into a
/// panic or a failure; and failures exit with their kind's code (a step that
/// is not newer: 75, "try again later / resync").
#[test]
fn closed_stdout_and_exit_codes() {
    let work = tempfile::tempdir().unwrap();
    let bucket = work.path().join("bucket");
    std::fs::create_dir_all(&bucket).unwrap();
    let url = url::Url::from_directory_path(&bucket).unwrap().to_string();
    let state = work.path().join("state");
    let g = Generator::new(GeneratorConfig::tiny(13));
    let ckpt = checkpoint(&g, &work.path().join("ckpt"));
    let run = |step: &str, closed: bool| {
        let mut c = Command::new(env!("CARGO_BIN_EXE_weightcast"));
        c.args([
            "publish", "--quiet", "--store", &url, "--step", step, "--state",
        ])
        .arg(&state)
        .arg("--checkpoint")
        .arg(&ckpt)
        .env_remove("WEIGHTCAST_FAILPOINT")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
        let mut child = c.spawn().unwrap();
        if closed {
            drop(child.stdout.take());
        }
        child.wait_with_output().unwrap()
    };
    let first = run("5", true);
    assert!(
        first.status.success(),
        "{:?}: {}",
        first.status,
        String::from_utf8_lossy(&first.stderr)
    );
    let again = run("5", false);
    assert_eq!(
        again.status.code(),
        Some(75),
        "{}",
        String::from_utf8_lossy(&again.stderr)
    );
    assert!(String::from_utf8_lossy(&again.stderr).contains("not newer"));
    let manifest: serde_json::Value = serde_json::from_slice(
        &std::fs::read(bucket.join("versions/00000000000000000000.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(manifest["step"], 5, "the first run committed");
}
