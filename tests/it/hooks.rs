//! Engine hand-off: after each verified version the subscriber drives SGLang-
//! and vLLM-style reload endpoints (pause → reload → resume), a webhook and a
//! command. The engines are stand-in HTTP servers on loopback that record what
//! they were asked (no GPU engine runs here).

use crate::common;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Path as AxPath, State};
use axum::http::Uri;
use axum::routing::post;
use weightcast::generator::{Generator, GeneratorConfig};
use weightcast::hooks::Hook;
use weightcast::publisher::Publisher;
use weightcast::subscriber::status::Shared;
use weightcast::subscriber::{DaemonConfig, run};

pub(crate) type Log = Arc<Mutex<Vec<(String, String)>>>;

/// An HTTP server that records every POST (path with query, body).
pub(crate) async fn recorder() -> (String, Log) {
    let log: Log = Arc::new(Mutex::new(Vec::new()));
    async fn record(
        State(log): State<Log>,
        uri: Uri,
        _p: Option<AxPath<String>>,
        body: Bytes,
    ) -> &'static str {
        log.lock().unwrap().push((
            uri.path_and_query()
                .map(|p| p.to_string())
                .unwrap_or_default(),
            String::from_utf8_lossy(&body).to_string(),
        ));
        // A reload takes a moment, so the pause window is measurable.
        if uri.path().contains("update_weights") || uri.path().contains("collective_rpc") {
            tokio::time::sleep(Duration::from_millis(30)).await;
        }
        "{}"
    }
    let app = Router::new()
        .route("/{*p}", post(record))
        .with_state(log.clone());
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", l.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(l, app).await });
    (base, log)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hooks_run_after_each_verified_version() {
    let (store, _bucket) = common::local_store();
    let work = tempfile::tempdir().unwrap();
    let (sglang, sglang_log) = recorder().await;
    let (vllm, vllm_log) = recorder().await;
    let (hook, hook_log) = recorder().await;
    let marker = work.path().join("command-ran");
    let hooks: Vec<Hook> = vec![
        format!("sglang:{sglang}").parse().unwrap(),
        format!("vllm:{vllm}").parse().unwrap(),
        format!("webhook:{hook}/weights").parse().unwrap(),
        format!(
            "command:echo \"$WEIGHTCAST_VERSION $WEIGHTCAST_DIR $(wc -l < $WEIGHTCAST_CHANGED)\" >> {}",
            marker.display()
        )
        .parse()
        .unwrap(),
    ];
    let mut publisher = Publisher::open(
        store.clone(),
        common::publisher_config(&work.path().join("pub"), 10, None),
    )
    .await
    .unwrap();
    let mut g = Generator::new(GeneratorConfig::tiny(6));
    let publish = |g: &Generator, v: u64| {
        let dir = work.path().join(format!("ckpt-{v}"));
        std::fs::create_dir_all(&dir).unwrap();
        let mut f = std::fs::File::create(dir.join("model.safetensors")).unwrap();
        g.snapshot().write_to(&BTreeMap::new(), &mut f).unwrap();
        dir
    };
    publisher
        .publish_path(&publish(&g, 0), &Default::default())
        .await
        .unwrap();

    let out = work.path().join("sub");
    let shared = Shared::new(store.url(), None);
    let cfg = DaemonConfig {
        poll_interval: Duration::from_millis(50),
        id: None,
        notify_url: None,
        hooks,
        ..DaemonConfig::new(&out)
    };
    let (st, sh) = (store.clone(), shared.clone());
    tokio::spawn(async move { run(&st, &cfg, &sh, std::future::pending()).await });

    let wait = |v: u64| {
        let shared = shared.clone();
        let hook_log = hook_log.clone();
        async move {
            let deadline = Instant::now() + Duration::from_secs(20);
            while shared.status.lock().unwrap().version != Some(v)
                || hook_log.lock().unwrap().len() < v as usize + 1
            {
                assert!(
                    Instant::now() < deadline,
                    "v{v} not handed off: {:?} {:?}",
                    shared.status.lock().unwrap(),
                    hook_log.lock().unwrap()
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };
    wait(0).await;
    g.step();
    publisher
        .publish_path(&publish(&g, 1), &Default::default())
        .await
        .unwrap();
    wait(1).await;

    let current = out.join("current").to_string_lossy().to_string();
    // SGLang: pause, reload from DIR/current, resume — per version, in order.
    let s = sglang_log.lock().unwrap().clone();
    let paths: Vec<&str> = s.iter().map(|(p, _)| p.as_str()).collect();
    assert_eq!(
        paths,
        [
            "/pause_generation",
            "/update_weights_from_disk",
            "/continue_generation"
        ]
        .repeat(2)
    );
    let body: serde_json::Value = serde_json::from_str(&s[1].1).unwrap();
    assert_eq!(body["model_path"], current);
    // SGLang is told the weight version, and paused in retract mode (its
    // requests survive; their KV cache is recomputed with the new weights).
    assert_eq!(body["weight_version"], "0");
    let pause: serde_json::Value = serde_json::from_str(&s[0].1).unwrap();
    assert_eq!(pause["mode"], "retract");
    // vLLM: dev endpoints.
    let v = vllm_log.lock().unwrap().clone();
    let paths: Vec<&str> = v.iter().map(|(p, _)| p.as_str()).collect();
    assert_eq!(
        paths,
        ["/pause?mode=keep", "/collective_rpc", "/resume"].repeat(2)
    );
    assert!(v[1].1.contains("reload_weights"));
    // Webhook: the event, with the changed tensors of the delta version.
    let h = hook_log.lock().unwrap().clone();
    let e0: serde_json::Value = serde_json::from_str(&h[0].1).unwrap();
    let e1: serde_json::Value = serde_json::from_str(&h[1].1).unwrap();
    assert_eq!(
        (e0["version"].as_u64(), e1["version"].as_u64()),
        (Some(0), Some(1))
    );
    assert_eq!(
        e0["changed_tensors"].as_array().unwrap().len(),
        Generator::new(GeneratorConfig::tiny(6)).snapshot().len(),
        "anchor: every tensor is listed (any may have changed)"
    );
    assert!(
        !e1["changed_tensors"].as_array().unwrap().is_empty(),
        "{e1}"
    );
    // Command: ran with the version, the directory and the changed list.
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::fs::read_to_string(&marker)
        .map(|t| t.lines().count())
        .unwrap_or(0)
        < 2
    {
        assert!(Instant::now() < deadline, "command hook did not run twice");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let lines = std::fs::read_to_string(&marker).unwrap();
    assert!(
        lines
            .lines()
            .next()
            .unwrap()
            .starts_with(&format!("0 {current}")),
        "{lines}"
    );
    assert!(
        lines
            .lines()
            .nth(1)
            .unwrap()
            .starts_with(&format!("1 {current}")),
        "{lines}"
    );
    // The pause window was measured (it covers the 30 ms reload, not the download).
    let status = shared.status.lock().unwrap().clone();
    assert!(status.last_pause_seconds >= 0.03, "{status:?}");
    assert_eq!(status.hook_failures, 0);
}

/// An engine that fails for a while: the hook is retried with backoff until
/// it succeeds; one that refuses (4xx) is not retried, the failure is
/// reported by kind, the daemon's health says so, the standby slot is left
/// alone, and the hook runs again (and succeeds) before the next update.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hooks_retry_and_an_unconfirmed_engine_keeps_the_previous_version() {
    use std::sync::atomic::{AtomicU32, Ordering};
    use weightcast::hooks::{Event, HookErrorKind, HookPolicy, run as run_hooks};

    // Answers 503 to the first `fail` reloads, then 200; `refuse` answers 404
    // to every reload while set.
    #[derive(Clone)]
    struct Engine {
        calls: Arc<AtomicU32>,
        fail: Arc<AtomicU32>,
        refuse: Arc<std::sync::atomic::AtomicBool>,
    }
    async fn handle(State(e): State<Engine>, uri: Uri) -> (axum::http::StatusCode, &'static str) {
        if !uri.path().contains("update_weights") {
            return (axum::http::StatusCode::OK, "{}");
        }
        e.calls.fetch_add(1, Ordering::SeqCst);
        if e.refuse.load(Ordering::SeqCst) {
            return (axum::http::StatusCode::NOT_FOUND, "no such endpoint");
        }
        if e.fail.load(Ordering::SeqCst) > 0 {
            e.fail.fetch_sub(1, Ordering::SeqCst);
            return (axum::http::StatusCode::SERVICE_UNAVAILABLE, "busy");
        }
        (axum::http::StatusCode::OK, "{}")
    }
    let engine = Engine {
        calls: Arc::new(AtomicU32::new(0)),
        fail: Arc::new(AtomicU32::new(2)),
        refuse: Arc::new(std::sync::atomic::AtomicBool::new(false)),
    };
    let app = Router::new()
        .route("/{*p}", post(handle))
        .with_state(engine.clone());
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", l.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(l, app).await });
    let hooks: Vec<Hook> = vec![format!("sglang:{base}").parse().unwrap()];
    let fast = HookPolicy {
        backoff: Duration::from_millis(10),
        budget: Duration::from_secs(5),
        ..HookPolicy::default()
    };
    let event = Event {
        version: 3,
        dir: "/tmp/x".into(),
        changed_tensors: Vec::new(),
    };
    // Two 503s, then success: three attempts, no failure.
    let r = run_hooks(&hooks, &event, &fast).await;
    assert_eq!(
        (r.failed, engine.calls.load(Ordering::SeqCst)),
        (0, 3),
        "{r:?}"
    );
    // A 404 is not retried and is reported as a refusal.
    engine.refuse.store(true, Ordering::SeqCst);
    engine.calls.store(0, Ordering::SeqCst);
    let r = run_hooks(&hooks, &event, &fast).await;
    assert_eq!(r.failed, 1);
    assert_eq!(r.failures[0].kind, HookErrorKind::Refused);
    assert_eq!(
        (r.failures[0].attempts, engine.calls.load(Ordering::SeqCst)),
        (1, 1)
    );
    assert!(r.error().unwrap().contains("404"), "{:?}", r.error());
    // Down for longer than the budget: Unreachable after a few attempts.
    let down = Hook::Sglang("http://127.0.0.1:9".into());
    let r = run_hooks(
        &[down],
        &event,
        &HookPolicy {
            budget: Duration::from_millis(200),
            backoff: Duration::from_millis(50),
            ..HookPolicy::default()
        },
    )
    .await;
    assert_eq!(r.failures[0].kind, HookErrorKind::Unreachable);
    assert!(r.failures[0].attempts >= 2, "{r:?}");

    // In the daemon: an engine refusing version 1 keeps the output's previous
    // slot untouched and /healthz-worthy status, and the hooks run again.
    let (store, _bucket) = common::local_store();
    let work = tempfile::tempdir().unwrap();
    let mut publisher = Publisher::open(
        store.clone(),
        common::publisher_config(&work.path().join("pub"), 10, None),
    )
    .await
    .unwrap();
    let mut g = Generator::new(GeneratorConfig::tiny(16));
    let ckpt = |g: &Generator, v: u64| {
        let dir = work.path().join(format!("ckpt-{v}"));
        std::fs::create_dir_all(&dir).unwrap();
        let mut f = std::fs::File::create(dir.join("model.safetensors")).unwrap();
        g.snapshot().write_to(&BTreeMap::new(), &mut f).unwrap();
        dir
    };
    engine.refuse.store(false, Ordering::SeqCst);
    publisher
        .publish_path(&ckpt(&g, 0), &Default::default())
        .await
        .unwrap();
    let out = work.path().join("sub");
    let shared = Shared::new(store.url(), None);
    let cfg = DaemonConfig {
        poll_interval: Duration::from_millis(50),
        hooks: hooks.clone(),
        hook_policy: fast.clone(),
        ..DaemonConfig::new(&out)
    };
    let (st, sh) = (store.clone(), shared.clone());
    tokio::spawn(async move { run(&st, &cfg, &sh, std::future::pending()).await });
    let until = |what: &str, f: &dyn Fn() -> bool| {
        let deadline = Instant::now() + Duration::from_secs(20);
        while !f() {
            assert!(
                Instant::now() < deadline,
                "{what}: {:?}",
                shared.status.lock().unwrap()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    until("v0 handed off", &|| {
        let s = shared.status.lock().unwrap();
        s.version == Some(0) && s.hook_runs >= 1 && s.last_hook_error.is_none()
    });
    // The standby slot is brought forward after a confirmed switch.
    until("standby ready", &|| {
        std::fs::read_dir(out.join("slots"))
            .map(|d| d.count())
            .unwrap_or(0)
            >= 2
    });
    engine.refuse.store(true, Ordering::SeqCst);
    g.step();
    publisher
        .publish_path(&ckpt(&g, 1), &Default::default())
        .await
        .unwrap();
    until("v1 switched, engine unconfirmed", &|| {
        let s = shared.status.lock().unwrap();
        s.version == Some(1) && s.last_hook_error.is_some()
    });
    // The slot v0 lives in is the engine's until it confirms: untouched.
    let target = std::fs::read_link(out.join("current")).unwrap();
    let other: Vec<_> = std::fs::read_dir(out.join("slots"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| !p.ends_with(target.file_name().unwrap()))
        .collect();
    let before = std::fs::read(other[0].join("model.safetensors")).unwrap();
    let runs = shared.status.lock().unwrap().hook_runs;
    until("hooks retried", &|| {
        shared.status.lock().unwrap().hook_runs >= runs + 2
    });
    assert_eq!(
        std::fs::read(other[0].join("model.safetensors")).unwrap(),
        before
    );
    assert!(shared.status.lock().unwrap().last_error.is_some());
    // The engine comes back: confirmed, healthy again.
    engine.refuse.store(false, Ordering::SeqCst);
    until("confirmed", &|| {
        let s = shared.status.lock().unwrap();
        s.last_hook_error.is_none() && s.last_error.is_none()
    });
}
