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
    let client = reqwest::Client::new();
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
            422,
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
