//! Notifications end to end over loopback HTTP: a publisher's signed POST makes
//! a subscriber catch up at once; unauthenticated or malformed requests change
//! nothing.

use crate::common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use weightcast::generator::{Generator, GeneratorConfig};
use weightcast::notify::{Key, SIGNATURE_HEADER, TIMESTAMP_HEADER, unix_now};
use weightcast::protocol::registrations;
use weightcast::publisher::Publisher;
use weightcast::store::Store;
use weightcast::subscriber::status::Shared;
use weightcast::subscriber::{DaemonConfig, run};

const SECRET: &str = "a-test-secret-of-enough-length";

async fn start_subscriber(store: &Store, out: &std::path::Path) -> (Arc<Shared>, String) {
    let shared = Shared::new(store.url(), Some(Key::new(SECRET).unwrap()));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let s = shared.clone();
    tokio::spawn(weightcast::http::subscriber::serve(
        listener,
        s,
        std::future::pending(),
    ));
    let cfg = DaemonConfig {
        // Far longer than the test: only a notification can make it catch up.
        poll_interval: Duration::from_secs(3600),
        id: Some("rollout-1".into()),
        notify_url: Some(format!("{base}/v1/notify")),
        hooks: Vec::new(),
        ..DaemonConfig::new(out)
    };
    let (st, sh) = (store.clone(), shared.clone());
    tokio::spawn(async move { run(&st, &cfg, &sh, std::future::pending()).await });
    (shared, base)
}

fn version(shared: &Shared) -> Option<u64> {
    shared.status.lock().unwrap().version
}

async fn wait_for_version(shared: &Shared, v: u64) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while version(shared) != Some(v) {
        assert!(
            Instant::now() < deadline,
            "subscriber did not reach v{v}: {:?}",
            shared.status.lock().unwrap()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn notifications_wake_subscribers_and_bad_ones_are_refused() {
    let work = tempfile::tempdir().unwrap();
    let url = url::Url::from_directory_path(work.path().join("bucket")).unwrap();
    let store = Store::open(url.as_str()).unwrap();
    let mut g = Generator::new(GeneratorConfig::tiny(4));
    let write = |g: &Generator, v: u64| {
        let dir = work.path().join(format!("ckpt-{v}"));
        std::fs::create_dir_all(&dir).unwrap();
        let mut f = std::fs::File::create(dir.join("model.safetensors")).unwrap();
        g.snapshot().write_to(&BTreeMap::new(), &mut f).unwrap();
        dir
    };
    let mut publisher = Publisher::open(
        store.clone(),
        common::publisher_config(
            &work.path().join("pub"),
            10,
            Some(Key::new(SECRET).unwrap()),
        ),
    )
    .await
    .unwrap();
    publisher
        .publish_path(&write(&g, 0), &Default::default())
        .await
        .unwrap();

    let (shared, base) = start_subscriber(&store, &work.path().join("sub")).await;
    wait_for_version(&shared, 0).await; // the first catch-up runs at start
    // It registered itself, so the publisher finds it without configuration.
    let deadline = Instant::now() + Duration::from_secs(10);
    while registrations(&store).await.unwrap().is_empty() {
        assert!(Instant::now() < deadline, "no registration");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // Publish: the signed POST wakes the subscriber long before its poll.
    g.step();
    let out = publisher
        .publish_path(&write(&g, 1), &Default::default())
        .await
        .unwrap();
    // Sent in the background: the publish did not wait for it.
    assert_eq!(out.notified, None);
    assert_eq!(publisher.notifications_settled().await, 1);
    wait_for_version(&shared, 1).await;
    assert_eq!(shared.status.lock().unwrap().notifications, 1);

    // Hostile requests: refused with 4xx, counted, and they wake nothing.
    g.step();
    // v2 committed without notifying anyone (a publisher without the key).
    let mut quiet = Publisher::open(
        store.clone(),
        common::publisher_config(&work.path().join("pub"), 10, None),
    )
    .await
    .unwrap();
    drop(publisher);
    assert_eq!(
        quiet
            .publish_path(&write(&g, 2), &Default::default())
            .await
            .unwrap()
            .notified,
        Some(0)
    );
    let client = common::http_client();
    let body = format!(
        r#"{{"store":"{}","version":2,"anchor_version":0}}"#,
        store.url()
    );
    let ts = unix_now().to_string();
    let wrong = Key::new("some-other-secret-value")
        .unwrap()
        .sign(unix_now(), body.as_bytes());
    let cases: Vec<(Option<&str>, Option<String>, String, u16)> = vec![
        (None, None, body.clone(), 401),
        (Some(&ts), Some(wrong), body.clone(), 401),
        (
            Some("12"),
            Some(Key::new(SECRET).unwrap().sign(12, body.as_bytes())),
            body.clone(),
            401,
        ),
        (Some(&ts), Some("v1=00".into()), body.clone(), 401),
        (Some(&ts), None, "x".repeat(10_000), 413),
    ];
    for (t, sig, b, want) in cases {
        let mut req = client.post(format!("{base}/v1/notify")).body(b);
        if let Some(t) = t {
            req = req.header(TIMESTAMP_HEADER, t);
        }
        if let Some(sig) = sig {
            req = req.header(SIGNATURE_HEADER, sig);
        }
        let r = req.send().await.unwrap();
        assert_eq!(r.status().as_u16(), want);
    }
    // Signed but for another store: refused too.
    let other = r#"{"store":"s3://elsewhere","version":9,"anchor_version":0}"#;
    let now = unix_now();
    let r = client
        .post(format!("{base}/v1/notify"))
        .header(TIMESTAMP_HEADER, now.to_string())
        .header(
            SIGNATURE_HEADER,
            Key::new(SECRET).unwrap().sign(now, other.as_bytes()),
        )
        .body(other)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 400);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        version(&shared),
        Some(1),
        "a refused notification woke the subscriber"
    );
    assert!(shared.status.lock().unwrap().refused >= 5);

    // A valid hint for v2 (sent by hand): caught up.
    let now = unix_now();
    let r = client
        .post(format!("{base}/v1/notify"))
        .header(TIMESTAMP_HEADER, now.to_string())
        .header(
            SIGNATURE_HEADER,
            Key::new(SECRET).unwrap().sign(now, body.as_bytes()),
        )
        .body(body.clone())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 202);
    wait_for_version(&shared, 2).await;
    // The same signed notification again (a captured one, replayed within
    // the clock-skew window): refused, it cannot drive store requests.
    let r = client
        .post(format!("{base}/v1/notify"))
        .header(TIMESTAMP_HEADER, now.to_string())
        .header(
            SIGNATURE_HEADER,
            Key::new(SECRET).unwrap().sign(now, body.as_bytes()),
        )
        .body(body.clone())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 409, "a replay was accepted");

    // Status and metrics.
    let status: serde_json::Value = client
        .get(format!("{base}/v1/status"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(status["version"], 2);
    // Anonymous callers see no store URL; the notify key as a bearer token
    // shows the full view.
    assert!(!status.to_string().contains(store.url()), "{status}");
    assert!(status.get("store").is_none(), "{status}");
    let full: serde_json::Value = client
        .get(format!("{base}/v1/status"))
        .header("authorization", format!("Bearer {SECRET}"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(full["store"], store.url());
    assert_eq!(full["status"]["version"], 2);
    let metrics = client
        .get(format!("{base}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(metrics.contains("weightcast_version 2"), "{metrics}");
    assert!(metrics.contains("weightcast_notifications_refused_total"));
    let families = common::parse_prometheus(&metrics);
    common::assert_dashboard_covers(&families, |f| !f.starts_with("weightcast_publisher_"));
    for f in [
        "weightcast_version",
        "weightcast_lag_versions",
        "weightcast_hook_failures",
        "weightcast_healthy",
    ] {
        assert!(families.iter().any(|x| x == f), "{f} missing: {families:?}");
    }
    // Slowloris: a client that never finishes its headers is cut off.
    {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let addr = base.trim_start_matches("http://");
        let mut slow = tokio::net::TcpStream::connect(addr).await.unwrap();
        slow.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
            .await
            .unwrap();
        let started = Instant::now();
        let mut buf = Vec::new();
        let read = tokio::time::timeout(Duration::from_secs(20), slow.read_to_end(&mut buf)).await;
        assert!(
            read.is_ok(),
            "the server kept a half-sent request open for 20 s"
        );
        assert!(
            started.elapsed() >= Duration::from_secs(9),
            "closed after {:?}",
            started.elapsed()
        );
    }
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
}
