//! The subscriber's HTTP endpoint: `POST /v1/notify` (authenticated hint),
//! `GET /v1/status`, `GET /healthz`, `GET /metrics` (Prometheus text).
//!
//! [`run`] takes a bound listener and a shutdown future, so tests bind port 0.
//! A notification never carries weights and is never trusted beyond "look at
//! the bucket now": it only wakes the catch-up loop, and bursts coalesce into
//! one wake-up.

use std::future::Future;
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::IntoResponse;
use axum::routing::{get, post};
use serde::Serialize;
use tokio::net::TcpListener;
use tokio::sync::Notify;

use crate::notify::{Key, MAX_BODY, Notification, SIGNATURE_HEADER, TIMESTAMP_HEADER, unix_now};

/// What `/v1/status` reports.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Status {
    /// The verified version materialized in the output directory.
    pub version: Option<u64>,
    /// The newest committed version seen in the bucket.
    pub newest: Option<u64>,
    /// `newest - version`.
    pub lag: Option<u64>,
    /// The last catch-up error, cleared by the next success.
    pub last_error: Option<String>,
    /// Versions applied since start.
    pub versions_applied: u64,
    /// Bytes downloaded since start.
    pub bytes_downloaded: u64,
    /// Bytes written into new version directories since start.
    pub bytes_written: u64,
    /// Bytes of new versions taken from the previous one (links, clones) since start.
    pub bytes_reused: u64,
    /// Re-bootstraps after a failed replay.
    pub repairs: u64,
    /// Catch-ups that failed.
    pub failures: u64,
    /// Accepted notifications.
    pub notifications: u64,
    /// Refused notifications (authentication, size, format).
    pub refused: u64,
    /// Seconds spent in the last catch-up that changed the version.
    pub last_apply_seconds: f64,
    /// The engine's pause window for the last version (pause answered → resume answered).
    pub last_pause_seconds: f64,
    /// Hooks that failed.
    pub hook_failures: u64,
}

/// State shared by the HTTP handlers and the catch-up loop.
pub struct Shared {
    /// The status.
    pub status: Mutex<Status>,
    /// Wakes the catch-up loop.
    pub wake: Notify,
    /// The notify secret; without one every notification is refused.
    pub key: Option<Key>,
    /// The store URL this subscriber follows (notifications for others are refused).
    pub store_url: String,
}

impl Shared {
    /// Shared state for a subscriber of `store_url`.
    pub fn new(store_url: impl Into<String>, key: Option<Key>) -> Arc<Shared> {
        Arc::new(Shared {
            status: Mutex::new(Status::default()),
            wake: Notify::new(),
            key,
            store_url: store_url.into(),
        })
    }

    fn refuse(&self, code: StatusCode, why: &str) -> (StatusCode, String) {
        if let Ok(mut s) = self.status.lock() {
            s.refused += 1;
        }
        (code, format!("{why}\n"))
    }
}

/// The routes.
pub fn router(shared: Arc<Shared>) -> Router {
    Router::new()
        .route("/v1/notify", post(notify))
        .route("/v1/status", get(status))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/metrics", get(metrics))
        .layer(DefaultBodyLimit::max(MAX_BODY))
        .with_state(shared)
}

/// Serves until `shutdown` completes.
pub async fn run(
    listener: TcpListener,
    shared: Arc<Shared>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, router(shared))
        .with_graceful_shutdown(shutdown)
        .await
}

async fn notify(
    State(shared): State<Arc<Shared>>,
    headers: HeaderMap,
    body: Bytes,
) -> impl IntoResponse {
    let Some(key) = &shared.key else {
        return shared.refuse(
            StatusCode::FORBIDDEN,
            "notifications are disabled (no notify key configured)",
        );
    };
    let h = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    if let Err(e) = key.verify(h(TIMESTAMP_HEADER), h(SIGNATURE_HEADER), &body, unix_now()) {
        return shared.refuse(StatusCode::UNAUTHORIZED, &e.to_string());
    }
    let n: Notification = match serde_json::from_slice(&body) {
        Ok(n) => n,
        Err(e) => {
            return shared.refuse(
                StatusCode::BAD_REQUEST,
                &format!("malformed notification: {e}"),
            );
        }
    };
    if n.store != shared.store_url {
        return shared.refuse(StatusCode::BAD_REQUEST, "notification is for another store");
    }
    if let Ok(mut s) = shared.status.lock() {
        s.notifications += 1;
        s.newest = Some(s.newest.map_or(n.version, |v| v.max(n.version)));
    }
    shared.wake.notify_one();
    (StatusCode::ACCEPTED, "accepted\n".to_string())
}

async fn status(State(shared): State<Arc<Shared>>) -> impl IntoResponse {
    let s = shared.status.lock().map(|s| s.clone()).unwrap_or_default();
    axum::Json(s)
}

async fn metrics(State(shared): State<Arc<Shared>>) -> impl IntoResponse {
    let s = shared.status.lock().map(|s| s.clone()).unwrap_or_default();
    let mut out = String::new();
    let mut metric = |name: &str, kind: &str, help: &str, value: f64| {
        out.push_str(&format!(
            "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}\n"
        ));
    };
    metric(
        "weightcast_version",
        "gauge",
        "Verified version in the output directory.",
        s.version.map_or(-1.0, |v| v as f64),
    );
    metric(
        "weightcast_lag_versions",
        "gauge",
        "Committed versions not yet applied.",
        s.lag.unwrap_or(0) as f64,
    );
    metric(
        "weightcast_versions_applied_total",
        "counter",
        "Versions applied.",
        s.versions_applied as f64,
    );
    metric(
        "weightcast_bytes_downloaded_total",
        "counter",
        "Bytes downloaded from the store.",
        s.bytes_downloaded as f64,
    );
    metric(
        "weightcast_output_written_bytes_total",
        "counter",
        "Bytes written into new version directories.",
        s.bytes_written as f64,
    );
    metric(
        "weightcast_output_reused_bytes_total",
        "counter",
        "Bytes of new versions hard-linked or cloned from the previous one.",
        s.bytes_reused as f64,
    );
    metric(
        "weightcast_repairs_total",
        "counter",
        "Re-bootstraps from an anchor after a failed replay.",
        s.repairs as f64,
    );
    metric(
        "weightcast_failures_total",
        "counter",
        "Catch-ups that failed.",
        s.failures as f64,
    );
    metric(
        "weightcast_notifications_total",
        "counter",
        "Accepted notifications.",
        s.notifications as f64,
    );
    metric(
        "weightcast_notifications_refused_total",
        "counter",
        "Refused notifications.",
        s.refused as f64,
    );
    metric(
        "weightcast_apply_seconds",
        "gauge",
        "Duration of the last catch-up that changed the version.",
        s.last_apply_seconds,
    );
    metric(
        "weightcast_engine_pause_seconds",
        "gauge",
        "Engine pause window of the last version (pause answered to resume answered).",
        s.last_pause_seconds,
    );
    metric(
        "weightcast_hook_failures_total",
        "counter",
        "Hooks that failed.",
        s.hook_failures as f64,
    );
    ([("content-type", "text/plain; version=0.0.4")], out)
}

/// State of the publisher daemon (`weightcast publisher`).
pub struct PublisherShared {
    /// The publisher; publishes are serialized.
    pub publisher: tokio::sync::Mutex<crate::publisher::Publisher>,
    /// BLAKE3 of the bearer token clients must present.
    pub token_hash: blake3::Hash,
    /// Checkpoints must lie under this directory (canonical).
    pub root: std::path::PathBuf,
}

impl PublisherShared {
    /// Daemon state: requests need `Authorization: Bearer <token>` and may only
    /// name checkpoints under `root`.
    pub fn new(
        publisher: crate::publisher::Publisher,
        token: &str,
        root: &std::path::Path,
    ) -> crate::Result<Arc<PublisherShared>> {
        if token.len() < 16 {
            return Err(crate::Error::Config(
                "the API token must be at least 16 characters".into(),
            ));
        }
        let root = root
            .canonicalize()
            .map_err(|e| crate::Error::io(format!("checkpoint root {}", root.display()), e))?;
        Ok(Arc::new(PublisherShared {
            publisher: tokio::sync::Mutex::new(publisher),
            token_hash: blake3::hash(token.as_bytes()),
            root,
        }))
    }
}

/// Body of `POST /v1/publish`.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct PublishRequest {
    checkpoint: std::path::PathBuf,
}

/// The publisher daemon's routes: `POST /v1/publish`, `GET /healthz`.
pub fn publisher_router(shared: Arc<PublisherShared>) -> Router {
    Router::new()
        .route("/v1/publish", post(publish))
        .route("/healthz", get(|| async { "ok\n" }))
        .layer(DefaultBodyLimit::max(MAX_BODY))
        .with_state(shared)
}

/// Serves the publisher daemon until `shutdown` completes.
pub async fn run_publisher(
    listener: TcpListener,
    shared: Arc<PublisherShared>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, publisher_router(shared))
        .with_graceful_shutdown(shutdown)
        .await
}

async fn publish(
    State(shared): State<Arc<PublisherShared>>,
    headers: HeaderMap,
    body: Bytes,
) -> axum::response::Response {
    let error = |code: StatusCode, msg: String| {
        (code, axum::Json(serde_json::json!({ "error": msg }))).into_response()
    };
    let presented = headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    // Compare hashes: constant time, and the token itself is not kept.
    if presented.map(|t| blake3::hash(t.as_bytes())) != Some(shared.token_hash) {
        return error(
            StatusCode::UNAUTHORIZED,
            "missing or wrong bearer token".into(),
        );
    }
    let req: PublishRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => {
            return error(
                StatusCode::BAD_REQUEST,
                format!("expected {{\"checkpoint\": PATH}}: {e}"),
            );
        }
    };
    let path = match req.checkpoint.canonicalize() {
        Ok(p) => p,
        Err(e) => {
            return error(
                StatusCode::BAD_REQUEST,
                format!("checkpoint {}: {e}", req.checkpoint.display()),
            );
        }
    };
    if !path.starts_with(&shared.root) {
        return error(
            StatusCode::FORBIDDEN,
            format!("checkpoint must be under {}", shared.root.display()),
        );
    }
    let mut p = shared.publisher.lock().await;
    match p.publish(&path).await {
        Ok(published) => (StatusCode::OK, axum::Json(published)).into_response(),
        Err(e @ crate::Error::Config(_)) | Err(e @ crate::Error::StructureChanged(_)) => {
            error(StatusCode::UNPROCESSABLE_ENTITY, e.to_string())
        }
        Err(e) => error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
    }
}
