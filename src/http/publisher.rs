//! The publisher daemon's HTTP endpoint (`weightcast publisher`):
//!
//! - `POST /v1/publish {"checkpoint": PATH, "step": N}` with
//!   `Authorization: Bearer <token>` publishes PATH (under the checkpoint
//!   root) as the next version and answers what `weightcast publish` prints
//!   as soon as the version is committed, without `notified`: the
//!   subscribers are notified in the background; errors answer
//!   `{"error", "kind"}` with the status of their kind.
//! - `GET /healthz`: 200, or 503 with the reason when the last publish failed
//!   for a reason the daemon cannot fix alone (the store unreachable, bad
//!   configuration, local I/O); a lost race or a foreign commit is not one —
//!   the publisher resyncs and goes on.
//! - `GET /metrics`: Prometheus text, `weightcast_publisher_*` series.
//! - `GET /v1/status`: version, step and health; with the bearer token also
//!   the store URL, counters and the last error (never to anonymous callers).
//!
//! [`serve`] takes a bound listener and a shutdown future, so tests bind port 0.

use std::future::Future;
use std::sync::Arc;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::IntoResponse;
use axum::routing::{get, post};
use tokio::net::TcpListener;

use crate::error::ErrorKind;
use crate::notify::MAX_BODY;

/// What the publisher daemon reports about itself.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct PublisherStats {
    /// The last committed version.
    pub version: Option<u64>,
    /// Its trainer step.
    pub step: Option<u64>,
    /// Versions committed, by kind.
    pub anchors: u64,
    /// Versions committed as deltas.
    pub deltas: u64,
    /// Publishes of content identical to the last version (no-ops).
    pub unchanged: u64,
    /// Bytes written to the bucket.
    pub bytes: u64,
    /// Changed elements published.
    pub changed_elements: u64,
    /// Seconds the last successful publish took.
    pub last_publish_seconds: f64,
    /// Bytes the publishes caused to be written to local storage (state
    /// directory; `/proc/self/io` write_bytes).
    pub local_write_bytes: u64,
    /// The same for the last publish.
    pub last_local_write_bytes: u64,
    /// Failed publishes, by error kind.
    pub errors: std::collections::BTreeMap<&'static str, u64>,
    /// The last error.
    pub last_error: Option<String>,
    /// Why the daemon is unhealthy, if it is.
    pub unhealthy: Option<String>,
}

/// State of the publisher daemon (`weightcast publisher`).
pub struct PublisherShared {
    /// Counters and health.
    pub stats: std::sync::Mutex<PublisherStats>,
    /// The publisher; publishes are serialized.
    pub publisher: tokio::sync::Mutex<crate::publisher::Publisher>,
    /// BLAKE3 of the bearer token clients must present.
    pub token_hash: blake3::Hash,
    /// Checkpoints must lie under this directory (canonical).
    pub root: std::path::PathBuf,
    /// How checkpoint directories are read (links must stay under `root`).
    pub checkpoint: crate::publisher::CheckpointOptions,
    /// The graceful shutdown as the publish handler sees it.
    pub drain: super::Drain,
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
        let stats = PublisherStats {
            version: publisher.version(),
            ..Default::default()
        };
        Ok(Arc::new(PublisherShared {
            stats: std::sync::Mutex::new(stats),
            publisher: tokio::sync::Mutex::new(publisher),
            token_hash: blake3::hash(token.as_bytes()),
            root,
            checkpoint,
            drain: super::Drain::default(),
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
        .route("/healthz", get(healthz))
        .route("/metrics", get(metrics))
        .route("/v1/status", get(status))
        .layer(DefaultBodyLimit::max(MAX_BODY))
        .layer(axum::Extension(Arc::new(super::Exposition::new(Metrics(
            shared.clone(),
        )))))
        .with_state(shared)
}

/// How long a publish in flight may go on after a shutdown signal, by
/// default (`weightcast publisher --shutdown-grace`).
pub const DEFAULT_SHUTDOWN_GRACE: std::time::Duration = std::time::Duration::from_secs(30);

/// Serves the publisher daemon until `shutdown` completes, then shuts down
/// gracefully with [`DEFAULT_SHUTDOWN_GRACE`] (see [`serve_with_grace`]).
pub async fn serve(
    listener: TcpListener,
    shared: Arc<PublisherShared>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    serve_with_grace(listener, shared, shutdown, DEFAULT_SHUTDOWN_GRACE).await
}

/// Serves the publisher daemon until `shutdown` completes, then shuts down
/// gracefully: requests arriving from then on are answered 503
/// `unavailable`; a publish in flight may finish within `grace`; after it, a
/// publish whose commit has not begun is stopped (nothing of it is
/// committed; its caller gets 503 `unavailable`) and one whose commit has
/// begun runs to its end, so that its caller learns the version.
pub async fn serve_with_grace(
    listener: TcpListener,
    shared: Arc<PublisherShared>,
    shutdown: impl Future<Output = ()> + Send + 'static,
    grace: std::time::Duration,
) -> std::io::Result<()> {
    let drain = shared.drain.clone();
    // A publish of an anchor can take many minutes: only the headers are
    // timed (slowloris), the request may take up to a day.
    super::serve_hardened(
        listener,
        router(shared),
        std::time::Duration::from_secs(24 * 3600),
        shutdown,
        drain,
        grace,
    )
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
    if !super::bearer_ok(&headers, &shared.token_hash) {
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
    // Publishes are serialized; one queued behind another when the daemon
    // starts shutting down never starts.
    let mut p = tokio::select! {
        p = shared.publisher.lock() => p,
        () = shared.drain.expired() => return super::shutting_down(),
    };
    if shared.drain.is_draining() {
        return super::shutting_down();
    }
    let opts = crate::publisher::PublishOptions { step: req.step };
    let started = std::time::Instant::now();
    let gate = p.commit_gate();
    let publish = async {
        match crate::publisher::Checkpoint::open(&path, &shared.checkpoint) {
            Ok(cp) => p.publish(cp, &opts).await,
            Err(e) => Err(e),
        }
    };
    tokio::pin!(publish);
    let published = tokio::select! {
        r = &mut publish => r,
        () = shared.drain.expired() => {
            if gate.stop() {
                // No commit has begun: what was uploaded is never
                // referenced, and the state directory is as it was.
                tracing::warn!(
                    checkpoint = %path.display(),
                    "shutdown: publish stopped before its commit; nothing was committed"
                );
                Err(crate::Error::Unavailable(format!(
                    "the publisher shut down before `{}` was committed: nothing of it is \
                     visible; publish it again once the publisher is back",
                    req.checkpoint.display()
                )))
            } else {
                let _hold = shared.drain.hold();
                tracing::warn!(
                    checkpoint = %path.display(),
                    "shutdown: the grace period is over but this publish is committing; \
                     waiting for it"
                );
                publish.await
            }
        }
    };
    let mut stats = shared.stats.lock().unwrap_or_else(|e| e.into_inner());
    match published {
        Ok(out) => {
            tracing::info!(
                checkpoint = %path.display(),
                version = out.version,
                kind = ?out.kind,
                step = ?out.step,
                bytes = out.bytes,
                changed = out.changed,
                unchanged = out.unchanged,
                anchor_reason = ?out.anchor_reason,
                "published"
            );
            stats.version = Some(out.version);
            stats.step = out.step;
            if out.unchanged {
                stats.unchanged += 1;
            } else if out.kind == crate::protocol::VersionKind::Anchor {
                stats.anchors += 1;
            } else {
                stats.deltas += 1;
            }
            stats.bytes += out.bytes;
            stats.changed_elements += out.changed;
            stats.last_publish_seconds = started.elapsed().as_secs_f64();
            if let Some(w) = out.local_write_bytes {
                stats.local_write_bytes += w;
                stats.last_local_write_bytes = w;
            }
            stats.unhealthy = None;
            (StatusCode::OK, axum::Json(out)).into_response()
        }
        Err(e) => {
            let kind = e.kind();
            tracing::warn!(checkpoint = %path.display(), error = %e, kind = %kind, "publish failed");
            *stats.errors.entry(kind.as_str()).or_default() += 1;
            stats.last_error = Some(e.to_string());
            // The caller's mistakes and races do not make the daemon sick;
            // an unreachable store, bad configuration or local I/O do.
            if matches!(
                kind,
                ErrorKind::Unavailable | ErrorKind::Config | ErrorKind::Io | ErrorKind::Corrupt
            ) {
                stats.unhealthy = Some(format!("last publish failed ({kind}): {e}"));
            }
            super::error_response(&e)
        }
    }
}

async fn healthz(State(shared): State<Arc<PublisherShared>>) -> axum::response::Response {
    let stats = shared.stats.lock().unwrap_or_else(|e| e.into_inner());
    match &stats.unhealthy {
        None => (StatusCode::OK, "ok\n").into_response(),
        Some(why) => (StatusCode::SERVICE_UNAVAILABLE, format!("{why}\n")).into_response(),
    }
}

async fn status(
    State(shared): State<Arc<PublisherShared>>,
    headers: HeaderMap,
) -> axum::response::Response {
    let stats = shared
        .stats
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone();
    if super::bearer_ok(&headers, &shared.token_hash) {
        let store = shared.publisher.lock().await.store().url().to_string();
        axum::Json(serde_json::json!({ "store": store, "healthy": stats.unhealthy.is_none(), "stats": stats }))
            .into_response()
    } else {
        // Anonymous callers learn no store, endpoint or error text.
        axum::Json(serde_json::json!({
            "version": stats.version,
            "step": stats.step,
            "healthy": stats.unhealthy.is_none(),
        }))
        .into_response()
    }
}

async fn metrics(
    axum::Extension(exposition): axum::Extension<Arc<super::Exposition>>,
) -> axum::response::Response {
    exposition.response()
}

/// The publisher daemon's families, read from its stats at each scrape.
struct Metrics(Arc<PublisherShared>);

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("publisher metrics")
    }
}

impl prometheus_client::collector::Collector for Metrics {
    fn encode(&self, encoder: prometheus_client::encoding::DescriptorEncoder) -> std::fmt::Result {
        let s = self
            .0
            .stats
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let mut m = super::Families::new(encoder);
        m.gauge(
            "weightcast_publisher_version",
            "The last committed version (-1: none yet).",
            super::version_gauge(s.version),
        )?;
        m.gauge(
            "weightcast_publisher_step",
            "The trainer step of the last version (-1: unknown).",
            super::version_gauge(s.step),
        )?;
        m.counters(
            "weightcast_publisher_versions",
            "Versions committed, by kind (unchanged: identical content, nothing written).",
            "kind",
            &[
                ("anchor", s.anchors),
                ("delta", s.deltas),
                ("unchanged", s.unchanged),
            ],
        )?;
        m.counter(
            "weightcast_publisher_bytes",
            "Bytes written to the bucket.",
            s.bytes,
        )?;
        m.counter(
            "weightcast_publisher_changed_elements",
            "Changed elements published.",
            s.changed_elements,
        )?;
        m.gauge(
            "weightcast_publisher_publish_seconds",
            "Duration of the last successful publish.",
            s.last_publish_seconds,
        )?;
        m.counter(
            "weightcast_publisher_local_written_bytes",
            "Bytes written to local storage by the publishes (/proc/self/io write_bytes).",
            s.local_write_bytes,
        )?;
        m.gauge(
            "weightcast_publisher_last_local_written_bytes",
            "Bytes written to local storage by the last publish.",
            s.last_local_write_bytes,
        )?;
        let errors: Vec<(&str, u64)> = [
            ErrorKind::NotFound,
            ErrorKind::Precondition,
            ErrorKind::Corrupt,
            ErrorKind::BadRequest,
            ErrorKind::Unavailable,
            ErrorKind::Config,
            ErrorKind::Io,
        ]
        .into_iter()
        .map(|k| (k.as_str(), s.errors.get(k.as_str()).copied().unwrap_or(0)))
        .collect();
        m.counters(
            "weightcast_publisher_errors",
            "Failed publishes, by error kind.",
            "kind",
            &errors,
        )?;
        m.gauge(
            "weightcast_publisher_healthy",
            "1 when healthy, 0 when /healthz answers 503.",
            u64::from(s.unhealthy.is_none()),
        )
    }
}
