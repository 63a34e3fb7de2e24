//! The subscriber daemon's HTTP endpoint: `POST /v1/notify` (authenticated
//! hint), `GET /v1/status`, `GET /healthz`, `GET /metrics` (Prometheus text).
//!
//! [`serve`] takes a bound listener and a shutdown future, so tests bind port
//! 0. A notification never carries weights and is never trusted beyond "look
//! at the bucket now": it only wakes the catch-up loop, and bursts coalesce
//! into one wake-up.

use std::future::Future;
use std::sync::Arc;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::IntoResponse;
use axum::routing::{get, post};
use tokio::net::TcpListener;

use crate::notify::{MAX_BODY, Notification, SIGNATURE_HEADER, TIMESTAMP_HEADER, unix_now};
use crate::subscriber::status::Shared;

fn refuse(shared: &Shared, code: StatusCode, why: &str) -> (StatusCode, String) {
    if let Ok(mut s) = shared.status.lock() {
        s.refused += 1;
    }
    (code, format!("{why}\n"))
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
pub async fn serve(
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
        return refuse(
            &shared,
            StatusCode::FORBIDDEN,
            "notifications are disabled (no notify key configured)",
        );
    };
    let h = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    if let Err(e) = key.verify(h(TIMESTAMP_HEADER), h(SIGNATURE_HEADER), &body, unix_now()) {
        return refuse(&shared, StatusCode::UNAUTHORIZED, &e.to_string());
    }
    let n: Notification = match serde_json::from_slice(&body) {
        Ok(n) => n,
        Err(e) => {
            return refuse(
                &shared,
                StatusCode::BAD_REQUEST,
                &format!("malformed notification: {e}"),
            );
        }
    };
    if n.store != shared.store_url {
        return refuse(
            &shared,
            StatusCode::BAD_REQUEST,
            "notification is for another store",
        );
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
        "Bytes written into output slots (anchors, files, patched elements, slot rebuilds).",
        s.bytes_written as f64,
    );
    metric(
        "weightcast_journal_applied_bytes_total",
        "counter",
        "Bytes of journal objects applied to bring output slots forward.",
        s.bytes_journal as f64,
    );
    metric(
        "weightcast_store_requests_total",
        "counter",
        "Requests made to the store.",
        s.store_requests as f64,
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
