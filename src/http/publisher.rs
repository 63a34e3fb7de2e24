//! The publisher daemon's HTTP endpoint (`weightcast publisher`): `POST
//! /v1/publish {"checkpoint": PATH}` with a bearer token publishes PATH as the
//! next version; `GET /healthz`. [`serve`] takes a bound listener and a
//! shutdown future, so tests bind port 0.

use std::future::Future;
use std::sync::Arc;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::IntoResponse;
use axum::routing::{get, post};
use tokio::net::TcpListener;

use crate::notify::MAX_BODY;

/// State of the publisher daemon (`weightcast publisher`).
pub struct PublisherShared {
    /// The publisher; publishes are serialized.
    pub publisher: tokio::sync::Mutex<crate::publisher::Publisher>,
    /// BLAKE3 of the bearer token clients must present.
    pub token_hash: blake3::Hash,
    /// Checkpoints must lie under this directory (canonical).
    pub root: std::path::PathBuf,
    /// How checkpoint directories are read (links must stay under `root`).
    pub checkpoint: crate::publisher::CheckpointOptions,
}

impl PublisherShared {
    /// Daemon state: requests need `Authorization: Bearer <token>` and may only
    /// name checkpoints under `root`.
    pub fn new(
        publisher: crate::publisher::Publisher,
        token: &str,
        root: &std::path::Path,
        checkpoint: crate::publisher::CheckpointOptions,
    ) -> crate::Result<Arc<PublisherShared>> {
        if token.len() < 16 {
            return Err(crate::Error::Config(
                "the API token must be at least 16 characters".into(),
            ));
        }
        let root = root
            .canonicalize()
            .map_err(|e| crate::Error::io(format!("checkpoint root {}", root.display()), e))?;
        let checkpoint = crate::publisher::CheckpointOptions {
            root: Some(root.clone()),
            ..checkpoint
        };
        Ok(Arc::new(PublisherShared {
            publisher: tokio::sync::Mutex::new(publisher),
            token_hash: blake3::hash(token.as_bytes()),
            root,
            checkpoint,
        }))
    }
}

/// Body of `POST /v1/publish`.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct PublishRequest {
    checkpoint: std::path::PathBuf,
    #[serde(default)]
    step: Option<u64>,
}

/// Resolves a requested checkpoint path under `root` without touching the
/// filesystem first: absolute paths must lie under the root, relative ones
/// are taken from it, and `..`/`.` components are refused outright (so the
/// answer never depends on what exists outside the root).
fn resolve(
    root: &std::path::Path,
    requested: &std::path::Path,
) -> Result<std::path::PathBuf, String> {
    use std::path::Component;
    let rel = if requested.is_absolute() {
        requested
            .strip_prefix(root)
            .map_err(|_| format!("checkpoint must be under {}", root.display()))?
    } else {
        requested
    };
    if rel.components().any(|c| !matches!(c, Component::Normal(_))) {
        return Err(format!(
            "checkpoint path `{}` must be a plain path under {} (no `..` or `.`)",
            requested.display(),
            root.display()
        ));
    }
    Ok(root.join(rel))
}

/// The publisher daemon's routes: `POST /v1/publish`, `GET /healthz`.
pub fn router(shared: Arc<PublisherShared>) -> Router {
    Router::new()
        .route("/v1/publish", post(publish))
        .route("/healthz", get(|| async { "ok\n" }))
        .layer(DefaultBodyLimit::max(MAX_BODY))
        .with_state(shared)
}

/// Serves the publisher daemon until `shutdown` completes.
pub async fn serve(
    listener: TcpListener,
    shared: Arc<PublisherShared>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, router(shared))
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
                format!("expected {{\"checkpoint\": PATH, \"step\": N (optional)}}: {e}"),
            );
        }
    };
    let path = match resolve(&shared.root, &req.checkpoint) {
        Ok(p) => p,
        Err(why) => return error(StatusCode::FORBIDDEN, why),
    };
    let mut p = shared.publisher.lock().await;
    let opts = crate::publisher::PublishOptions { step: req.step };
    let published = match crate::publisher::Checkpoint::open(&path, &shared.checkpoint) {
        Ok(cp) => p.publish(cp, &opts).await,
        Err(e) => Err(e),
    };
    match published {
        Ok(published) => (StatusCode::OK, axum::Json(published)).into_response(),
        Err(e) => super::error_response(&e),
    }
}
