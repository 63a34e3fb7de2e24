//! The subscriber daemon's HTTP endpoint: `POST /v1/notify` (authenticated
//! hint), `GET /v1/status`, `GET /healthz`, `GET /metrics` (Prometheus text).
//!
//! [`serve`] takes a bound listener and a shutdown future, so tests bind port
//! 0. A notification never carries weights and is never trusted beyond "look
//! at the bucket now": it only wakes the catch-up loop, and bursts coalesce
//! into one wake-up. A notification is accepted once: a replay of a signed
//! one within the clock-skew window is refused.
//!
//! The server is hardened for an open port: request headers must arrive
//! within 10 s (slowloris), a whole request within 30 s, at most 64
//! connections are served at once (more wait in the kernel's backlog), bodies
//! are capped at 4 KiB. `/v1/status` shows the store URL and error texts only
//! to callers presenting the notify key as a bearer token; anonymous callers
//! see versions, lag and health.

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
        .route("/healthz", get(healthz))
        .route("/metrics", get(metrics))
        .layer(DefaultBodyLimit::max(MAX_BODY))
        .layer(axum::Extension(Arc::new(super::Exposition::new(Metrics(
            shared.clone(),
        )))))
        .with_state(shared)
}

pub use super::{HEADER_TIMEOUT, MAX_CONNECTIONS};
/// Time a whole request may take.
pub const REQUEST_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// A subscriber endpoint served in the background (an embedding's, e.g.
/// the Python binding's listening subscriber): dropping it stops the server.
pub struct Endpoint {
    /// The state the handlers share with the subscriber.
    pub shared: Arc<Shared>,
    /// The address it is bound to.
    pub bound: std::net::SocketAddr,
    _stop: tokio::sync::oneshot::Sender<()>,
}

impl std::fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Endpoint")
            .field("bound", &self.bound)
            .finish()
    }
}

/// Binds `listen` (`HOST:PORT`; port 0 picks one) and serves the endpoint
/// for a subscriber of `store_url` in a task of the current runtime,
/// accepting notifications signed with `key`.
pub async fn spawn(
    store_url: &str,
    listen: &str,
    key: Option<crate::notify::Key>,
) -> crate::Result<Endpoint> {
    use crate::Error;
    let addr: std::net::SocketAddr = listen.parse().map_err(|e| {
        Error::Config(format!(
            "listen `{listen}`: {e}; expected HOST:PORT, e.g. 0.0.0.0:8471"
        ))
    })?;
    let key = key.ok_or_else(|| {
        Error::Config(
            "listening needs the notify key (--notify-key, notify_key=: the publisher's \
             secret): every unsigned notification is refused"
                .into(),
        )
    })?;
    let shared = Shared::new(store_url, Some(key));
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|e| Error::io(format!("binding {addr}"), e))?;
    let bound = listener
        .local_addr()
        .map_err(|e| Error::io(format!("binding {addr}"), e))?;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let s = shared.clone();
    tokio::spawn(async move {
        let shutdown = async move {
            let _ = stopped.await;
        };
        if let Err(e) = serve(listener, s, shutdown).await {
            tracing::error!(error = %e, "notify endpoint stopped");
        }
    });
    tracing::info!(%bound, "serving /v1/notify, /v1/status, /healthz, /metrics");
    Ok(Endpoint {
        shared,
        bound,
        _stop: stop,
    })
}

/// Serves until `shutdown` completes.
pub async fn serve(
    listener: TcpListener,
    shared: Arc<Shared>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    // Nothing here takes long: in-flight requests get a few seconds.
    super::serve_hardened(
        listener,
        router(shared),
        REQUEST_TIMEOUT,
        shutdown,
        super::Drain::default(),
        std::time::Duration::from_secs(5),
    )
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
    let now = unix_now();
    if let Err(e) = key.verify(h(TIMESTAMP_HEADER), h(SIGNATURE_HEADER), &body, now) {
        return refuse(&shared, StatusCode::UNAUTHORIZED, &e.to_string());
    }
    // Once only: remember accepted signatures for as long as their timestamp
    // is fresh enough to verify.
    let sig = *blake3::hash(h(SIGNATURE_HEADER).unwrap_or_default().as_bytes()).as_bytes();
    {
        let mut seen = shared.seen.lock().unwrap_or_else(|e| e.into_inner());
        let window = crate::notify::MAX_SKEW.as_secs() * 2;
        while seen
            .front()
            .is_some_and(|(at, _)| now.saturating_sub(*at) > window)
        {
            seen.pop_front();
        }
        if seen.iter().any(|(_, s)| *s == sig) {
            drop(seen);
            return refuse(
                &shared,
                StatusCode::CONFLICT,
                "notification already accepted (replay)",
            );
        }
        if seen.len() >= 4096 {
            seen.pop_front();
        }
        seen.push_back((now, sig));
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

fn bearer_is_key(shared: &Shared, headers: &HeaderMap) -> bool {
    let Some(key) = &shared.key else {
        return false;
    };
    headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .is_some_and(|t| crate::notify::Key::new(t).is_ok_and(|k| k == *key))
}

async fn status(State(shared): State<Arc<Shared>>, headers: HeaderMap) -> axum::response::Response {
    let s = shared.status.lock().map(|s| s.clone()).unwrap_or_default();
    let healthy = s.last_error.is_none() && s.last_hook_error.is_none();
    if bearer_is_key(&shared, &headers) {
        axum::Json(serde_json::json!({
            "store": shared.store_url,
            "healthy": healthy,
            "status": s,
        }))
        .into_response()
    } else {
        // Anonymous callers learn no store, endpoint or error text.
        axum::Json(serde_json::json!({
            "version": s.version,
            "newest": s.newest,
            "lag": s.lag,
            "healthy": healthy,
        }))
        .into_response()
    }
}

async fn healthz(State(shared): State<Arc<Shared>>) -> axum::response::Response {
    let s = shared.status.lock().map(|s| s.clone()).unwrap_or_default();
    match (&s.last_error, &s.last_hook_error) {
        (None, None) => (StatusCode::OK, "ok\n").into_response(),
        (Some(e), _) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("last catch-up failed: {e}\n"),
        )
            .into_response(),
        (None, Some(e)) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("the engine has not confirmed the current version: {e}\n"),
        )
            .into_response(),
    }
}

async fn metrics(
    axum::Extension(exposition): axum::Extension<Arc<super::Exposition>>,
) -> axum::response::Response {
    exposition.response()
}

/// The subscriber's (and the relay's) families, read from its status at each
/// scrape.
struct Metrics(Arc<Shared>);

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("subscriber metrics")
    }
}

impl prometheus_client::collector::Collector for Metrics {
    fn encode(&self, encoder: prometheus_client::encoding::DescriptorEncoder) -> std::fmt::Result {
        let s = self.0.status.lock().map(|s| s.clone()).unwrap_or_default();
        let mut m = super::Families::new(encoder);
        m.gauge(
            "weightcast_version",
            "Verified version in the output (-1: none).",
            super::version_gauge(s.version),
        )?;
        m.gauge(
            "weightcast_newest_version",
            "Newest committed version seen (-1: none).",
            super::version_gauge(s.newest),
        )?;
        m.gauge(
            "weightcast_lag_versions",
            "Committed versions not yet applied.",
            s.lag.unwrap_or(0),
        )?;
        m.counter(
            "weightcast_versions_applied",
            "Versions applied.",
            s.versions_applied,
        )?;
        m.counter(
            "weightcast_bytes_downloaded",
            "Bytes downloaded from the store.",
            s.bytes_downloaded,
        )?;
        m.counter(
            "weightcast_output_written_bytes",
            "Bytes written into the output slots.",
            s.bytes_written,
        )?;
        m.counter(
            "weightcast_local_written_bytes",
            "Bytes written to local storage by the catch-ups (/proc/self/io write_bytes).",
            s.local_write_bytes,
        )?;
        m.gauge(
            "weightcast_last_version_local_written_bytes",
            "Bytes written to local storage for the last version (its standby slot included).",
            s.last_local_write_bytes,
        )?;
        m.counter(
            "weightcast_journal_applied_bytes",
            "Bytes of journal objects applied to bring slots forward.",
            s.bytes_journal,
        )?;
        m.counter(
            "weightcast_store_requests",
            "Requests made to the store.",
            s.store_requests,
        )?;
        m.counter(
            "weightcast_repairs",
            "Re-bootstraps after a failed replay or damaged output.",
            s.repairs,
        )?;
        m.counter("weightcast_failures", "Catch-ups that failed.", s.failures)?;
        m.counter(
            "weightcast_notifications",
            "Accepted notifications.",
            s.notifications,
        )?;
        m.counter(
            "weightcast_notifications_refused",
            "Refused notifications.",
            s.refused,
        )?;
        m.gauge(
            "weightcast_apply_seconds",
            "Duration of the last catch-up that changed the version.",
            s.last_apply_seconds,
        )?;
        m.gauge(
            "weightcast_engine_pause_seconds",
            "Engine pause window of the last version (pause answered to resume answered).",
            s.last_pause_seconds,
        )?;
        m.gauges(
            "weightcast_version_seconds",
            "Where the last version's time went, by phase: fetch (waiting on the store), \
             prepare (decode, verify, write off the serving path), pause (the engine's), apply \
             (commit and switch).",
            "phase",
            &[
                ("fetch", s.fetch_s),
                ("prepare", s.prepare_s),
                ("pause", s.pause_s),
                ("apply", s.apply_s),
            ],
        )?;
        let last = s.last_version.clone().unwrap_or_default();
        m.gauges(
            "weightcast_version_bytes",
            "The last version's bytes, by kind: downloaded from the store, written locally.",
            "kind",
            &[
                ("downloaded", last.bytes_downloaded as f64),
                ("written", last.bytes_written as f64),
            ],
        )?;
        m.counter("weightcast_hook_runs", "Hook runs.", s.hook_runs)?;
        m.counter(
            "weightcast_hook_failures",
            "Hooks that failed.",
            s.hook_failures,
        )?;
        m.gauge(
            "weightcast_quarantined_versions",
            "Versions that could not be verified and are skipped (retried with backoff).",
            s.quarantined.len() as u64,
        )?;
        m.gauge(
            "weightcast_ranks",
            "Ranks of a tensor-parallel engine this node subscriber follows for (0: not one).",
            s.rank_versions.len() as u64,
        )?;
        m.gauge(
            "weightcast_ranks_inconsistent",
            "1 when the engine's ranks hold different versions (an error), else 0.",
            u64::from(s.ranks_differ()),
        )?;
        let healthy = s.last_error.is_none() && s.last_hook_error.is_none();
        m.gauge(
            "weightcast_healthy",
            "1 when healthy, 0 when /healthz answers 503.",
            u64::from(healthy),
        )
    }
}
