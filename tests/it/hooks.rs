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
use axum::http::{HeaderMap, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
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
    // SGLang is told the weight version, and paused in abort mode, so the
    // update may flush its cache (the engine contracts are below).
    assert_eq!(body["weight_version"], "0");
    assert_eq!(body["flush_cache"], true);
    let pause: serde_json::Value = serde_json::from_str(&s[0].1).unwrap();
    assert_eq!(pause["mode"], "abort");
    // vLLM: dev endpoints. This recorder has no /openapi.json, so keep mode
    // cannot be confirmed: wait.
    let v = vllm_log.lock().unwrap().clone();
    let paths: Vec<&str> = v.iter().map(|(p, _)| p.as_str()).collect();
    assert_eq!(
        paths,
        [
            "/pause?mode=wait&wait_for_inflight_requests=true",
            "/collective_rpc",
            "/resume"
        ]
        .repeat(2)
    );
    let rpc: serde_json::Value = serde_json::from_str(&v[1].1).unwrap();
    assert_eq!(rpc["method"], "reload_weights");
    assert_eq!(rpc["kwargs"]["weights_path"], current);
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

// ---------------------------------------------------------------------------
// Engine contracts: stand-ins faithful to what the real engines do with the
// requests (checked against their sources, docs/integrations.md "Engine
// contracts"), not recorders that accept anything.
// ---------------------------------------------------------------------------

/// An SGLang-like server (`srt/entrypoints/http_server.py`, the tokenizer
/// manager's pause/continue, `scheduler_update_weights_mixin.py`):
///
/// - `pause_generation {"mode"}`: `abort` aborts every request in flight;
///   `retract` moves running requests to the waiting queue; `in_place` leaves
///   them running. New requests wait until `continue_generation`.
/// - `update_weights_from_disk {"model_path", "flush_cache" (default true),
///   "weight_version"}`: loads the files (a relative path resolves against
///   the engine's own directory: not found), or refuses with
///   `{"success": false}` and 400, keeping its weights; after a successful
///   load with `flush_cache` it flushes, which asserts that nothing is queued
///   or running — the scheduler dies otherwise (SGLang #20296) and the
///   server answers nothing more.
/// - `--api-key`: every request needs `Authorization: Bearer KEY` (401).
#[derive(Default)]
struct Sglang {
    key: Option<String>,
    /// Requests generating (running batch) and queued (waiting queue).
    running: usize,
    waiting: usize,
    aborted: usize,
    paused: Option<String>,
    /// Refuse the next updates: `Some(status)` answers `{"success": false}`
    /// with it (400 is SGLang's; 200 is what a proxy may pass on).
    refuse: Option<u16>,
    /// The scheduler died (a flush with requests in flight).
    crashed: bool,
    /// The weights it serves: the model path and version of the last
    /// accepted update.
    serving: Option<(String, String)>,
    /// Every request, in order: path, body.
    log: Vec<(String, serde_json::Value)>,
}

type EngineState<T> = Arc<Mutex<T>>;

fn authorized(key: &Option<String>, headers: &HeaderMap) -> bool {
    match key {
        None => true,
        Some(k) => headers
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v == format!("Bearer {k}")),
    }
}

fn json_response(status: u16, body: serde_json::Value) -> Response {
    (StatusCode::from_u16(status).unwrap(), axum::Json(body)).into_response()
}

async fn sglang_handle(
    State(e): State<EngineState<Sglang>>,
    headers: HeaderMap,
    uri: Uri,
    body: Bytes,
) -> Response {
    let mut e = e.lock().unwrap();
    if e.crashed {
        // The scheduler process died; the server is going down with it.
        return json_response(503, serde_json::json!({"error": "scheduler died"}));
    }
    if !authorized(&e.key, &headers) {
        return json_response(401, serde_json::json!({"error": "Unauthorized"}));
    }
    let body: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
    e.log.push((uri.path().to_string(), body.clone()));
    match uri.path() {
        "/pause_generation" => {
            let mode = body["mode"].as_str().unwrap_or("abort").to_string();
            match mode.as_str() {
                "abort" => {
                    e.aborted += e.running + e.waiting;
                    (e.running, e.waiting) = (0, 0);
                }
                "retract" => {
                    e.waiting += e.running;
                    e.running = 0;
                }
                "in_place" => {}
                other => {
                    return json_response(
                        400,
                        serde_json::json!({"error": format!("Invalid mode: {other}")}),
                    );
                }
            }
            e.paused = Some(mode);
            json_response(
                200,
                serde_json::json!({"message": "Generation paused successfully."}),
            )
        }
        "/continue_generation" => {
            e.paused = None;
            // Retracted requests are scheduled again.
            e.running += e.waiting;
            e.waiting = 0;
            json_response(
                200,
                serde_json::json!({"message": "Generation continued successfully."}),
            )
        }
        "/update_weights_from_disk" => {
            let path = body["model_path"].as_str().unwrap_or_default().to_string();
            if let Some(status) = e.refuse {
                return json_response(
                    status,
                    serde_json::json!({
                        "success": false,
                        "message": format!("Failed to get weights iterator: {path}. Rolling back to original weights."),
                        "num_paused_requests": 0,
                    }),
                );
            }
            if !std::path::Path::new(&path).is_absolute() || !std::path::Path::new(&path).is_dir() {
                return json_response(
                    400,
                    serde_json::json!({
                        "success": false,
                        "message": format!("Failed to get weights iterator: {path} (not found from the engine's directory). Rolling back to original weights."),
                        "num_paused_requests": 0,
                    }),
                );
            }
            let version = body["weight_version"]
                .as_str()
                .unwrap_or_default()
                .to_string();
            e.serving = Some((path, version));
            // `flush_cache` defaults to true; the flush asserts it succeeded,
            // and it refuses with anything queued or running.
            if body
                .get("flush_cache")
                .and_then(|f| f.as_bool())
                .unwrap_or(true)
                && e.running + e.waiting > 0
            {
                e.crashed = true;
                return json_response(
                    503,
                    serde_json::json!({"error": "AssertionError: Cache flush failed after updating weights"}),
                );
            }
            json_response(
                200,
                serde_json::json!({
                    "success": true,
                    "message": "Succeeded to update model weights.",
                    "num_paused_requests": 0,
                }),
            )
        }
        _ => json_response(404, serde_json::json!({"detail": "Not Found"})),
    }
}

/// Serves `app` on a loopback port; returns its base URL.
async fn serve(app: Router) -> String {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", l.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(l, app).await });
    base
}

async fn sglang(e: Sglang) -> (String, EngineState<Sglang>) {
    let state = Arc::new(Mutex::new(e));
    let app = Router::new()
        .route("/{*p}", axum::routing::any(sglang_handle))
        .with_state(state.clone());
    (serve(app).await, state)
}

fn fast_policy() -> weightcast::hooks::HookPolicy {
    weightcast::hooks::HookPolicy {
        backoff: Duration::from_millis(10),
        budget: Duration::from_secs(5),
        ..Default::default()
    }
}

/// SGLang: pause, update with the absolute path of the version, continue —
/// with requests in flight in every pause mode, no crash; the default
/// aborts them and flushes, retract and in_place keep them and do not
/// flush; a refused update (`{"success": false}`, with 400 or 200) is a
/// failure, and SGLang is not left paused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_contract_pause_update_continue_with_requests_in_flight() {
    use weightcast::hooks::{Event, HookErrorKind, SglangPause, run as run_hooks};
    let work = tempfile::tempdir().unwrap();
    let dir = work.path().join("out").join("current");
    std::fs::create_dir_all(&dir).unwrap();
    let event = Event {
        version: 7,
        dir: dir.clone(),
        changed_tensors: Vec::new(),
    };
    for (mode, survive) in [
        (None, false),
        (Some(SglangPause::Abort), false),
        (Some(SglangPause::Retract), true),
        (Some(SglangPause::InPlace), true),
    ] {
        let (base, engine) = sglang(Sglang {
            running: 3,
            waiting: 2,
            ..Default::default()
        })
        .await;
        let mut policy = fast_policy();
        if let Some(m) = mode {
            policy.sglang_pause = m;
        }
        let r = run_hooks(&[Hook::Sglang(base)], &event, &policy).await;
        let e = engine.lock().unwrap();
        assert!(!e.crashed, "{mode:?}: SGLang's scheduler died: {:?}", e.log);
        assert_eq!(r.failed, 0, "{mode:?}: {r:?}");
        let paths: Vec<&str> = e.log.iter().map(|(p, _)| p.as_str()).collect();
        assert_eq!(
            paths,
            [
                "/pause_generation",
                "/update_weights_from_disk",
                "/continue_generation"
            ]
        );
        assert_eq!(
            e.serving,
            Some((dir.to_string_lossy().to_string(), "7".to_string())),
            "{mode:?}: the version's absolute directory"
        );
        assert!(e.paused.is_none());
        // The requests in flight: kept by retract/in_place, aborted by abort.
        if survive {
            assert_eq!((e.running, e.aborted), (5, 0), "{mode:?}");
        } else {
            assert_eq!((e.running, e.aborted), (0, 5), "{mode:?}");
            // Nothing left in flight: the cache is rebuilt with the new weights.
            assert_eq!(e.log[1].1["flush_cache"], true);
        }
    }

    // A refused update: a failure naming SGLang's message, SGLang continued,
    // its weights unchanged.
    for status in [400, 200] {
        let (base, engine) = sglang(Sglang {
            running: 1,
            refuse: Some(status),
            ..Default::default()
        })
        .await;
        let r = run_hooks(&[Hook::Sglang(base)], &event, &fast_policy()).await;
        let e = engine.lock().unwrap();
        assert_eq!(r.failed, 1, "refused with {status}: {r:?}");
        assert_eq!(r.failures[0].kind, HookErrorKind::Refused);
        assert!(
            r.failures[0]
                .message
                .contains("Rolling back to original weights"),
            "{r:?}"
        );
        assert!(
            e.serving.is_none() && e.paused.is_none() && !e.crashed,
            "{:?}",
            e.log
        );
        assert_eq!(e.log.last().unwrap().0, "/continue_generation");
    }

    // A relative directory resolves against SGLang's own working directory:
    // refused, not served.
    let (base, engine) = sglang(Sglang::default()).await;
    let relative = Event {
        dir: "out/current".into(),
        ..event.clone()
    };
    let r = run_hooks(&[Hook::Sglang(base)], &relative, &fast_policy()).await;
    assert_eq!(r.failed, 1, "{r:?}");
    assert!(engine.lock().unwrap().serving.is_none());

    // --api-key: the bearer token, or a refusal naming the variable to set.
    let (base, engine) = sglang(Sglang {
        key: Some("sg-key".into()),
        ..Default::default()
    })
    .await;
    let hooks = [Hook::Sglang(base)];
    let r = run_hooks(&hooks, &event, &fast_policy()).await;
    assert_eq!(r.failures[0].kind, HookErrorKind::Refused, "{r:?}");
    assert!(
        r.failures[0].message.contains("WEIGHTCAST_SGLANG_API_KEY"),
        "{r:?}"
    );
    let keyed = weightcast::hooks::HookPolicy {
        sglang_api_key: weightcast::hooks::ApiKey::new("sg-key"),
        ..fast_policy()
    };
    let r = run_hooks(&hooks, &event, &keyed).await;
    assert_eq!(r.failed, 0, "{r:?}");
    assert!(engine.lock().unwrap().serving.is_some());
}

/// In the daemon: a version SGLang refuses is not reported as served (the
/// status keeps the previous one, the hooks are owed and run again), and it
/// is served once SGLang takes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_contract_refused_version_is_not_served() {
    let (store, _bucket) = common::local_store();
    let work = tempfile::tempdir().unwrap();
    let (base, engine) = sglang(Sglang {
        running: 2,
        ..Default::default()
    })
    .await;
    let mut publisher = Publisher::open(
        store.clone(),
        common::publisher_config(&work.path().join("pub"), 10, None),
    )
    .await
    .unwrap();
    let mut g = Generator::new(GeneratorConfig::tiny(8));
    let ckpt = |g: &Generator, v: u64| {
        let dir = work.path().join(format!("ckpt-{v}"));
        std::fs::create_dir_all(&dir).unwrap();
        let mut f = std::fs::File::create(dir.join("model.safetensors")).unwrap();
        g.snapshot().write_to(&BTreeMap::new(), &mut f).unwrap();
        dir
    };
    publisher
        .publish_path(&ckpt(&g, 0), &Default::default())
        .await
        .unwrap();
    let out = work.path().join("sub");
    let shared = Shared::new(store.url(), None);
    let cfg = DaemonConfig {
        poll_interval: Duration::from_millis(50),
        hooks: vec![Hook::Sglang(base)],
        hook_policy: fast_policy(),
        ..DaemonConfig::new(&out)
    };
    let (st, sh) = (store.clone(), shared.clone());
    tokio::spawn(async move { run(&st, &cfg, &sh, std::future::pending()).await });
    let until = |what: &str, f: &dyn Fn(&weightcast::subscriber::status::Status) -> bool| {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let s = shared.status.lock().unwrap().clone();
            if f(&s) {
                return s;
            }
            assert!(
                Instant::now() < deadline,
                "{what}: {s:?} {:?}",
                engine.lock().unwrap().log
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    until("v0 served", &|s| s.served_version == Some(0));
    engine.lock().unwrap().refuse = Some(400);
    g.step();
    publisher
        .publish_path(&ckpt(&g, 1), &Default::default())
        .await
        .unwrap();
    let s = until("v1 refused", &|s| {
        s.version == Some(1) && s.last_hook_error.is_some()
    });
    assert_eq!(s.served_version, Some(0), "a refused version is not served");
    assert!(
        s.last_hook_error
            .as_deref()
            .unwrap()
            .contains("Rolling back"),
        "{s:?}"
    );
    let runs = s.hook_runs;
    let s = until("hooks owed and run again", &|s| s.hook_runs >= runs + 2);
    assert_eq!(s.served_version, Some(0));
    engine.lock().unwrap().refuse = None;
    let s = until("v1 served", &|s| s.served_version == Some(1));
    assert!(s.last_hook_error.is_none());
    let e = engine.lock().unwrap();
    assert!(!e.crashed);
    assert_eq!(e.serving.as_ref().unwrap().1, "1");
    assert_eq!(
        std::path::PathBuf::from(&e.serving.as_ref().unwrap().0),
        out.join("current")
    );
}

/// A vLLM-like server (`vllm/entrypoints/serve/dev/rlhf/api_router.py`,
/// `AsyncLLM.pause_generation`, `serve/middleware/authenticate.py`):
///
/// - `POST /pause`: with `mode` (vLLM PR #32351 and later) `abort`, `wait`,
///   `keep`, anything else 422; `wait_for_inflight_requests=true` is taken
///   as `wait`. A server from before (PR #28037) has no `mode`: it ignores
///   the parameter and aborts unless `wait_for_inflight_requests=true`.
/// - `POST /collective_rpc {"method", "kwargs"}`; `POST /resume`.
/// - `GET /openapi.json` lists the parameters (absent with
///   `--disable-fastapi-docs`), public like `/health`.
/// - `--api-key`: everything else needs the bearer token (401).
#[derive(Default)]
struct Vllm {
    key: Option<String>,
    /// Has the `mode` parameter (and `keep`).
    modes: bool,
    /// Serves `/openapi.json`.
    docs: bool,
    in_flight: usize,
    frozen: usize,
    aborted: usize,
    finished: usize,
    paused: bool,
    /// The `kwargs` of each `collective_rpc("reload_weights")`.
    reloads: Vec<serde_json::Value>,
    log: Vec<String>,
}

async fn vllm_handle(
    State(e): State<EngineState<Vllm>>,
    method: Method,
    headers: HeaderMap,
    uri: Uri,
    body: Bytes,
) -> Response {
    let mut e = e.lock().unwrap();
    e.log.push(format!("{method} {uri}"));
    if uri.path() == "/openapi.json" {
        if !e.docs {
            return json_response(404, serde_json::json!({"detail": "Not Found"}));
        }
        let mut params = vec![
            serde_json::json!({"name": "wait_for_inflight_requests", "in": "query", "required": false, "schema": {"type": "boolean", "default": false}}),
            serde_json::json!({"name": "clear_cache", "in": "query", "required": false, "schema": {"type": "boolean", "default": true}}),
        ];
        if e.modes {
            params.insert(0, serde_json::json!({"name": "mode", "in": "query", "required": false,
                "schema": {"enum": ["abort", "wait", "keep"], "type": "string", "default": "abort", "title": "Mode"}}));
        }
        return json_response(
            200,
            serde_json::json!({"openapi": "3.1.0", "paths": {
                "/pause": {"post": {"parameters": params}},
                "/resume": {"post": {}},
                "/collective_rpc": {"post": {}},
            }}),
        );
    }
    if !authorized(&e.key, &headers) {
        return json_response(401, serde_json::json!({"error": "Unauthorized"}));
    }
    let query: BTreeMap<String, String> = uri
        .query()
        .unwrap_or("")
        .split('&')
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    match (method, uri.path()) {
        (Method::POST, "/pause") => {
            let wait_flag =
                query.get("wait_for_inflight_requests").map(String::as_str) == Some("true");
            let mode = if !e.modes {
                // No `mode` parameter: FastAPI ignores it.
                if wait_flag { "wait" } else { "abort" }
            } else {
                match query.get("mode").map(String::as_str).unwrap_or("abort") {
                    _ if wait_flag => "wait",
                    m @ ("abort" | "wait" | "keep") => m,
                    _ => {
                        return json_response(
                            422,
                            serde_json::json!({"detail": "mode: Input should be 'abort', 'wait' or 'keep'"}),
                        );
                    }
                }
            };
            match mode {
                "abort" => e.aborted += e.in_flight,
                "wait" => e.finished += e.in_flight,
                _ => e.frozen += e.in_flight,
            }
            e.in_flight = 0;
            e.paused = true;
            json_response(200, serde_json::json!({"status": "paused"}))
        }
        (Method::POST, "/collective_rpc") => {
            let body: serde_json::Value = match serde_json::from_slice(&body) {
                Ok(v) => v,
                Err(err) => {
                    return json_response(
                        400,
                        serde_json::json!({"detail": format!("JSON decode error: {err}")}),
                    );
                }
            };
            if body["method"] == "reload_weights" {
                e.reloads.push(body["kwargs"].clone());
            }
            json_response(200, serde_json::json!({"results": [null]}))
        }
        (Method::POST, "/resume") => {
            e.paused = false;
            e.in_flight += e.frozen;
            e.frozen = 0;
            json_response(200, serde_json::json!({"status": "resumed"}))
        }
        _ => json_response(404, serde_json::json!({"detail": "Not Found"})),
    }
}

async fn vllm(e: Vllm) -> (String, EngineState<Vllm>) {
    let state = Arc::new(Mutex::new(e));
    let app = Router::new()
        .route("/{*p}", axum::routing::any(vllm_handle))
        .with_state(state.clone());
    (serve(app).await, state)
}

/// vLLM: `mode=keep` only where the server lists it, `wait` otherwise —
/// requests in flight are never aborted unless asked; an explicit keep on a
/// server without it is refused before any pause; `reload_weights` gets the
/// version's directory; `--api-key` servers get the bearer token, and
/// without it the failure names the variable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_contract_keep_detection_api_key_and_weights_path() {
    use weightcast::hooks::{
        ApiKey, Event, HookErrorKind, HookPolicy, VllmPause, run as run_hooks,
    };
    let event = Event {
        version: 4,
        dir: "/srv/weights/current".into(),
        changed_tensors: Vec::new(),
    };
    // A current server with --api-key: keep, the key, weights_path.
    let (base, engine) = vllm(Vllm {
        key: Some("v-key".into()),
        modes: true,
        docs: true,
        in_flight: 4,
        ..Default::default()
    })
    .await;
    let hooks = [Hook::Vllm(base)];
    let r = run_hooks(&hooks, &event, &fast_policy()).await;
    assert_eq!(r.failures[0].kind, HookErrorKind::Refused, "{r:?}");
    assert!(r.failures[0].message.contains("401"), "{r:?}");
    assert!(
        r.failures[0].message.contains("WEIGHTCAST_VLLM_API_KEY"),
        "{r:?}"
    );
    let keyed = HookPolicy {
        vllm_api_key: ApiKey::new("v-key"),
        ..fast_policy()
    };
    let r = run_hooks(&hooks, &event, &keyed).await;
    assert_eq!(r.failed, 0, "{r:?}");
    {
        let e = engine.lock().unwrap();
        assert!(
            e.log.contains(&"POST /pause?mode=keep".to_string()),
            "{:?}",
            e.log
        );
        assert_eq!(
            (e.aborted, e.finished, e.in_flight),
            (0, 0, 4),
            "frozen, then resumed"
        );
        assert_eq!(
            e.reloads,
            [serde_json::json!({"weights_path": "/srv/weights/current"})]
        );
        assert!(!e.paused);
    }

    // Servers that cannot take keep (from before `mode`, with and without
    // the schema; a current one without the schema): wait, never abort.
    for (modes, docs) in [(false, true), (false, false), (true, false)] {
        let (base, engine) = vllm(Vllm {
            modes,
            docs,
            in_flight: 3,
            ..Default::default()
        })
        .await;
        let r = run_hooks(&[Hook::Vllm(base)], &event, &fast_policy()).await;
        let e = engine.lock().unwrap();
        assert_eq!(r.failed, 0, "modes {modes} docs {docs}: {r:?}");
        assert_eq!(
            (e.aborted, e.finished),
            (0, 3),
            "modes {modes} docs {docs}: {:?}",
            e.log
        );
        assert_eq!(e.reloads.len(), 1);
    }

    // keep asked of a server without it: refused before anything is paused.
    let (base, engine) = vllm(Vllm {
        modes: false,
        docs: true,
        in_flight: 2,
        ..Default::default()
    })
    .await;
    let keep = HookPolicy {
        vllm_pause: VllmPause::Keep,
        ..fast_policy()
    };
    let r = run_hooks(&[Hook::Vllm(base)], &event, &keep).await;
    assert_eq!(r.failures[0].kind, HookErrorKind::Refused, "{r:?}");
    assert!(r.failures[0].message.contains("mode=keep"), "{r:?}");
    let e = engine.lock().unwrap();
    assert_eq!((e.aborted, e.in_flight), (0, 2), "{:?}", e.log);
    assert!(e.reloads.is_empty() && !e.paused);
}
