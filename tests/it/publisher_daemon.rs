//! The publisher daemon over loopback HTTP: authenticated requests publish,
//! others are refused without touching the bucket.

use crate::common;

use std::collections::BTreeMap;

use weightcast::generator::{Generator, GeneratorConfig};
use weightcast::http::publisher::PublisherShared;
use weightcast::protocol::versions_after;
use weightcast::publisher::Publisher;
use weightcast::subscriber::catch_up;

const TOKEN: &str = "test-token-0123456789";

#[tokio::test]
async fn publish_over_http() {
    let (store, _bucket) = common::local_store();
    let work = tempfile::tempdir().unwrap();
    let root = work.path().join("checkpoints");
    std::fs::create_dir_all(&root).unwrap();
    let publisher = Publisher::open(
        store.clone(),
        common::publisher_config(&work.path().join("state"), 10, None),
    )
    .await
    .unwrap();
    assert!(
        PublisherShared::new(
            Publisher::open(
                store.clone(),
                common::publisher_config(&work.path().join("unused"), 10, None)
            )
            .await
            .unwrap(),
            "short",
            &root,
            Default::default()
        )
        .is_err()
    );
    let shared = PublisherShared::new(publisher, TOKEN, &root, Default::default()).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(weightcast::http::publisher::serve(
        listener,
        shared,
        std::future::pending(),
    ));

    let mut g = Generator::new(GeneratorConfig::tiny(8));
    let client = common::http_client();
    let post = |token: &'static str, body: serde_json::Value| {
        client
            .post(format!("{base}/v1/publish"))
            .header("authorization", format!("Bearer {token}"))
            .json(&body)
    };
    for v in 0..2u64 {
        if v > 0 {
            g.step();
        }
        let dir = root.join(format!("step-{v}"));
        std::fs::create_dir_all(&dir).unwrap();
        let mut f = std::fs::File::create(dir.join("model.safetensors")).unwrap();
        g.snapshot().write_to(&BTreeMap::new(), &mut f).unwrap();
        let r = post(
            TOKEN,
            serde_json::json!({ "checkpoint": dir, "step": 10 * v }),
        )
        .send()
        .await
        .unwrap();
        assert_eq!(r.status().as_u16(), 200);
        let out: serde_json::Value = r.json().await.unwrap();
        assert_eq!(out["version"], v);
        assert_eq!(out["step"], 10 * v);
        assert_eq!(out["kind"], if v == 0 { "anchor" } else { "delta" });
        assert!(out["bytes"].as_u64().unwrap() > 0);
    }
    // Steps must increase: an old step is refused with 409 — before the
    // identical-content rule, which would otherwise make it a no-op.
    let r = post(
        TOKEN,
        serde_json::json!({ "checkpoint": root.join("step-1"), "step": 10 }),
    )
    .send()
    .await
    .unwrap();
    assert_eq!(r.status().as_u16(), 409);
    let body: serde_json::Value = r.json().await.unwrap();
    assert!(
        body["error"].as_str().unwrap().contains("not newer"),
        "{body}"
    );
    // The same content again is a no-op that answers the last version.
    let r = post(
        TOKEN,
        serde_json::json!({ "checkpoint": root.join("step-1"), "step": 11 }),
    )
    .send()
    .await
    .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let out: serde_json::Value = r.json().await.unwrap();
    assert_eq!(
        (out["version"].as_u64(), out["unchanged"].as_bool()),
        (Some(1), Some(true))
    );
    // A malformed checkpoint is the caller's problem, named (D8).
    let bad = root.join("bad");
    std::fs::create_dir_all(&bad).unwrap();
    std::fs::write(bad.join("model.safetensors"), b"truncated").unwrap();
    let r = post(TOKEN, serde_json::json!({ "checkpoint": bad }))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 422);
    let body: serde_json::Value = r.json().await.unwrap();
    assert!(
        body["error"]
            .as_str()
            .unwrap()
            .contains("model.safetensors"),
        "{body}"
    );
    assert_eq!(body["kind"], "bad_request");

    // Refusals: no change to the bucket.
    let outside = work.path().join("elsewhere");
    std::fs::create_dir_all(&outside).unwrap();
    let cases = [
        (
            post(
                "wrong-token-0123456789",
                serde_json::json!({ "checkpoint": root.join("step-1") }),
            ),
            401,
        ),
        (
            post(TOKEN, serde_json::json!({ "checkpoint": outside })),
            403,
        ),
        (
            post(
                TOKEN,
                serde_json::json!({ "checkpoint": root.join("step-1/../../elsewhere") }),
            ),
            403,
        ),
        (
            post(
                TOKEN,
                serde_json::json!({ "checkpoint": root.join("missing") }),
            ),
            // Not found, as everywhere (exit code 66 from `publish`).
            404,
        ),
        (post(TOKEN, serde_json::json!({ "path": "x" })), 400),
    ];
    for (req, want) in cases {
        assert_eq!(req.send().await.unwrap().status().as_u16(), want);
    }
    let no_auth = client
        .post(format!("{base}/v1/publish"))
        .json(&serde_json::json!({ "checkpoint": root.join("step-1") }))
        .send()
        .await
        .unwrap();
    assert_eq!(no_auth.status().as_u16(), 401);
    assert_eq!(versions_after(&store, None).await.unwrap(), vec![0, 1]);
    let _ = &store;

    // Operator surface: metrics parse with Prometheus' own parser; status
    // shows no store to anonymous callers; health follows what the daemon
    // cannot fix alone.
    let metrics = client
        .get(format!("{base}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let families = common::parse_prometheus(&metrics);
    common::assert_dashboard_covers(&families, |f| f.starts_with("weightcast_publisher_"));
    for f in [
        "weightcast_publisher_version",
        "weightcast_publisher_versions",
        "weightcast_publisher_errors",
        "weightcast_publisher_healthy",
    ] {
        assert!(
            families.iter().any(|x| x == f),
            "{f} missing from {families:?}"
        );
    }
    assert!(
        metrics.contains("weightcast_publisher_versions_total{kind=\"delta\"} 1"),
        "{metrics}"
    );
    assert!(
        metrics.contains("weightcast_publisher_errors_total{kind=\"precondition\"} 1"),
        "{metrics}"
    );
    let anon: serde_json::Value = client
        .get(format!("{base}/v1/status"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(anon["version"], 1);
    assert!(!anon.to_string().contains(store.url()), "{anon}");
    assert!(!anon.to_string().contains("file://"), "{anon}");
    let full: serde_json::Value = client
        .get(format!("{base}/v1/status"))
        .header("authorization", format!("Bearer {TOKEN}"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(full["store"], store.url());
    assert_eq!(
        client
            .get(format!("{base}/healthz"))
            .send()
            .await
            .unwrap()
            .status()
            .as_u16(),
        200
    );
    // The bucket becomes unwritable (its `deltas` prefix is a file): the
    // publish fails, and /healthz says so until a publish succeeds again.
    let bucket = std::path::Path::new(_bucket.path());
    std::fs::rename(bucket.join("deltas"), bucket.join("deltas.aside")).unwrap();
    std::fs::write(bucket.join("deltas"), b"in the way").unwrap();
    g.step();
    let dir = root.join("step-2");
    std::fs::create_dir_all(&dir).unwrap();
    let mut f = std::fs::File::create(dir.join("model.safetensors")).unwrap();
    g.snapshot().write_to(&BTreeMap::new(), &mut f).unwrap();
    let r = post(TOKEN, serde_json::json!({ "checkpoint": dir }))
        .send()
        .await
        .unwrap();
    assert!(r.status().is_server_error(), "{}", r.status());
    let h = client.get(format!("{base}/healthz")).send().await.unwrap();
    assert_eq!(h.status().as_u16(), 503);
    assert!(h.text().await.unwrap().contains("last publish failed"));
    std::fs::remove_file(bucket.join("deltas")).unwrap();
    std::fs::rename(bucket.join("deltas.aside"), bucket.join("deltas")).unwrap();
    let r = post(TOKEN, serde_json::json!({ "checkpoint": dir }))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    assert_eq!(
        client
            .get(format!("{base}/healthz"))
            .send()
            .await
            .unwrap()
            .status()
            .as_u16(),
        200
    );

    // What was published replays.
    let sub = work.path().join("sub");
    assert_eq!(catch_up(&store, &sub).await.unwrap().unwrap().version, 2);
}

/// A running `weightcast publisher` process and the address it bound.
struct Daemon {
    child: std::process::Child,
    base: String,
    log: std::sync::Arc<std::sync::Mutex<String>>,
}

impl Daemon {
    /// Starts the real binary on port 0 and learns its port from its log.
    fn start(url: &str, state: &std::path::Path, root: &std::path::Path, grace: &str) -> Daemon {
        let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_weightcast"))
            .args(["publisher", "--store", url, "--listen", "127.0.0.1:0"])
            .args(["--token", TOKEN, "--shutdown-grace", grace, "--state"])
            .arg(state)
            .arg("--checkpoint-root")
            .arg(root)
            .env_remove("WEIGHTCAST_STORE")
            .env_remove("WEIGHTCAST_FAILPOINT")
            .env("RUST_LOG", "weightcast=info")
            .env("NO_COLOR", "1")
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let logged = crate::common::bound_address(
            &mut child,
            "the publisher daemon",
            std::time::Duration::from_secs(60),
        );
        let base = format!("http://{}", logged.addr);
        let log = logged.log;
        Daemon { child, base, log }
    }

    fn sigterm(&self) {
        let ok = std::process::Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .unwrap()
            .success();
        assert!(ok, "kill -TERM");
    }

    /// Waits for the process to exit (at most `within`), returning its log.
    fn exits(mut self, within: std::time::Duration) -> String {
        let deadline = std::time::Instant::now() + within;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                std::thread::sleep(std::time::Duration::from_millis(100));
                let log = self.log.lock().unwrap().clone();
                assert!(status.success(), "the daemon exited with {status}:\n{log}");
                return log;
            }
            if std::time::Instant::now() > deadline {
                let _ = self.child.kill();
                panic!(
                    "the daemon still runs {within:?} after SIGTERM:\n{}",
                    self.log.lock().unwrap()
                );
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
    }
}

/// Writes a checkpoint large enough that its anchor takes seconds to
/// publish (its files read, digested, compressed and uploaded).
fn large_checkpoint(dir: &std::path::Path, seed: u64) {
    std::fs::create_dir_all(dir).unwrap();
    let g = Generator::new(GeneratorConfig::with_elements(seed, 16 << 20));
    let mut f = std::fs::File::create(dir.join("model.safetensors")).unwrap();
    g.snapshot().write_to(&BTreeMap::new(), &mut f).unwrap();
    std::fs::write(dir.join("config.json"), b"{\"seed\": 1}").unwrap();
}

/// A SIGTERM during a publish leaves either a committed version (answered
/// 200) or a 503 `unavailable` and no new version; requests arriving during
/// the shutdown are refused with 503; the state restarts cleanly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sigterm_during_a_publish_leaves_a_committed_version_or_a_503() {
    let work = tempfile::tempdir().unwrap();
    let root = work.path().join("checkpoints");
    large_checkpoint(&root.join("a"), 1);
    let client = common::http_client();
    // One run per grace: the default-like 30 s (the publish finishes and is
    // answered) and 0 (it is stopped before its commit).
    let ckpt = "a";
    for grace in ["30", "0"] {
        let bucket = work.path().join(format!("bucket-{grace}"));
        let state = work.path().join(format!("state-{grace}"));
        let url = url::Url::from_directory_path(&bucket).unwrap().to_string();
        std::fs::create_dir_all(&bucket).unwrap();
        let store = weightcast::store::Store::open(&url).unwrap();
        let daemon = Daemon::start(&url, &state, &root, grace);
        let publish = client
            .post(format!("{}/v1/publish", daemon.base))
            .header("authorization", format!("Bearer {TOKEN}"))
            .json(&serde_json::json!({ "checkpoint": root.join(ckpt), "step": 7 }))
            .send();
        let in_flight = tokio::spawn(publish);
        // Mid-publish: the anchor's snapshot file is being written, or its
        // upload has begun.
        let started = std::time::Instant::now();
        while !state.join("next").exists() && !bucket.join("anchors").exists() {
            assert!(
                started.elapsed() < std::time::Duration::from_secs(120),
                "the publish never started"
            );
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        assert!(
            !in_flight.is_finished(),
            "grace {grace}: the publish ended too early"
        );
        daemon.sigterm();
        // A request arriving during the shutdown is refused, clearly.
        if grace != "0" {
            tokio::time::sleep(std::time::Duration::from_millis(200)).await;
            let late = client
                .post(format!("{}/v1/publish", daemon.base))
                .header("authorization", format!("Bearer {TOKEN}"))
                .json(&serde_json::json!({ "checkpoint": root.join(ckpt), "step": 8 }))
                .send()
                .await
                .unwrap();
            assert_eq!(late.status().as_u16(), 503, "grace {grace}: a late request");
            let body: serde_json::Value = late.json().await.unwrap();
            assert_eq!(body["kind"], "unavailable", "{body}");
            assert!(
                body["error"].as_str().unwrap().contains("shutting down"),
                "{body}"
            );
        }
        let answer = in_flight
            .await
            .unwrap()
            .unwrap_or_else(|e| panic!("grace {grace}: the publish got no answer: {e}"));
        let status = answer.status().as_u16();
        let body: serde_json::Value = answer.json().await.unwrap();
        let log = daemon.exits(std::time::Duration::from_secs(30));
        let versions = versions_after(&store, None).await.unwrap();
        match status {
            200 => {
                assert_eq!(body["version"], 0, "{body}");
                assert_eq!(versions, vec![0], "committed and answered");
            }
            503 => {
                assert_eq!(body["kind"], "unavailable", "{body}");
                assert!(
                    body["error"].as_str().unwrap().contains("not committed")
                        || body["error"].as_str().unwrap().contains("nothing of it"),
                    "{body}"
                );
                assert!(
                    versions.is_empty(),
                    "a 503 but version(s) {versions:?} in the bucket"
                );
            }
            other => panic!("grace {grace}: answered {other}: {body}\n{log}"),
        }
        // The grace of 30 s lets the publish finish; 0 stops it before its
        // commit (the anchor takes seconds to compress and upload).
        assert_eq!(
            status,
            if grace == "0" { 503 } else { 200 },
            "grace {grace}: {body}\n{log}"
        );
        // The state restarts cleanly: the next daemon publishes the same
        // checkpoint (an anchor if nothing was committed, else a no-op at the
        // committed version), and a subscriber reads exactly that.
        let daemon = Daemon::start(&url, &state, &root, "30");
        let r = client
            .post(format!("{}/v1/publish", daemon.base))
            .header("authorization", format!("Bearer {TOKEN}"))
            .json(&serde_json::json!({ "checkpoint": root.join(ckpt), "step": 9 }))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), 200, "after a restart");
        let out: serde_json::Value = r.json().await.unwrap();
        assert_eq!(out["version"], 0, "{out}");
        assert_eq!(
            out["unchanged"].as_bool().unwrap_or(false),
            status == 200,
            "{out}"
        );
        daemon.sigterm();
        daemon.exits(std::time::Duration::from_secs(30));
        let sub = work.path().join(format!("sub-{grace}"));
        let caught = catch_up(&store, &sub).await.unwrap().unwrap();
        assert_eq!(caught.version, 0);
        let got = weightcast::tensors::TensorSet::read(
            &sub.join("current/model.safetensors"),
            weightcast::tensors::Digests::Compute,
        )
        .unwrap();
        let want = weightcast::tensors::TensorSet::read(
            &root.join(ckpt).join("model.safetensors"),
            weightcast::tensors::Digests::Compute,
        )
        .unwrap();
        assert_eq!(got.digest(), want.digest(), "grace {grace}: the replica");
    }
}
