//! The daemons' HTTP surfaces, one module per daemon, each with a
//! `serve(listener, state, shutdown)` entry point (tests bind port 0):
//! [`subscriber`] (notify, status, health, metrics) and [`publisher`]
//! (publish requests). They sit above the library's publisher and subscriber
//! and translate its typed errors into HTTP answers in one place
//! ([`error_response`]).

pub mod publisher;
pub mod subscriber;

use axum::http::StatusCode;
use axum::response::IntoResponse;

/// The JSON error answer for a library error: the status its kind maps to
/// ([`crate::error::ErrorKind::http_status`]) and `{"error", "kind"}`.
pub fn error_response(e: &crate::Error) -> axum::response::Response {
    let kind = e.kind();
    let code =
        StatusCode::from_u16(kind.http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    (
        code,
        axum::Json(serde_json::json!({ "error": e.to_string(), "kind": kind.as_str() })),
    )
        .into_response()
}

/// Prometheus text exposition (format 0.0.4), written by hand: a handful of
/// series per daemon does not need a registry.
#[derive(Default)]
pub struct Prometheus {
    out: String,
}

impl Prometheus {
    /// Starts a metric family.
    pub fn family(&mut self, name: &str, kind: &str, help: &str) -> &mut Self {
        use std::fmt::Write;
        let help = help.replace('\\', "\\\\").replace('\n', "\\n");
        let _ = writeln!(self.out, "# HELP {name} {help}\n# TYPE {name} {kind}");
        self
    }

    /// One sample of the current family, with labels (values escaped).
    pub fn sample(&mut self, name: &str, labels: &[(&str, &str)], value: f64) -> &mut Self {
        use std::fmt::Write;
        self.out.push_str(name);
        if !labels.is_empty() {
            self.out.push('{');
            for (i, (k, v)) in labels.iter().enumerate() {
                if i > 0 {
                    self.out.push(',');
                }
                let v = v
                    .replace('\\', "\\\\")
                    .replace('"', "\\\"")
                    .replace('\n', "\\n");
                let _ = write!(self.out, "{k}=\"{v}\"");
            }
            self.out.push('}');
        }
        let value = if value.is_finite() {
            format!("{value}")
        } else if value.is_nan() {
            "NaN".into()
        } else if value > 0.0 {
            "+Inf".into()
        } else {
            "-Inf".into()
        };
        let _ = writeln!(self.out, " {value}");
        self
    }

    /// A family with one unlabelled sample.
    pub fn single(&mut self, name: &str, kind: &str, help: &str, value: f64) -> &mut Self {
        self.family(name, kind, help).sample(name, &[], value)
    }

    /// The response: the text with its content type.
    pub fn response(self) -> axum::response::Response {
        (
            [("content-type", "text/plain; version=0.0.4; charset=utf-8")],
            self.out,
        )
            .into_response()
    }

    /// The text.
    pub fn text(&self) -> &str {
        &self.out
    }
}

/// Whether `headers` carry `Authorization: Bearer <t>` with BLAKE3(t) = `hash`
/// (hashes compare in constant time; the token itself is never stored).
pub fn bearer_ok(headers: &axum::http::HeaderMap, hash: &blake3::Hash) -> bool {
    headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(|t| blake3::hash(t.as_bytes()))
        == Some(*hash)
}

/// Serves `app` on `listener` until `shutdown`, hardened for an open port: at
/// most [`subscriber::MAX_CONNECTIONS`] connections at once, request headers
/// within [`subscriber::HEADER_TIMEOUT`] (slowloris), each connection closed
/// after `request_timeout` (one request per connection).
pub async fn serve_hardened(
    listener: tokio::net::TcpListener,
    app: axum::Router,
    request_timeout: std::time::Duration,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    use hyper_util::rt::{TokioIo, TokioTimer};
    let slots = std::sync::Arc::new(tokio::sync::Semaphore::new(subscriber::MAX_CONNECTIONS));
    tokio::pin!(shutdown);
    loop {
        let permit = tokio::select! {
            _ = &mut shutdown => return Ok(()),
            p = slots.clone().acquire_owned() => p.expect("the semaphore is never closed"),
        };
        let (stream, _) = tokio::select! {
            _ = &mut shutdown => return Ok(()),
            a = listener.accept() => match a {
                Ok(a) => a,
                Err(e) => {
                    // Out of descriptors and the like: wait, do not spin.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                    continue;
                }
            },
        };
        let service = hyper_util::service::TowerToHyperService::new(app.clone());
        tokio::spawn(async move {
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(subscriber::HEADER_TIMEOUT)
                .keep_alive(false)
                .serve_connection(TokioIo::new(stream), service);
            match tokio::time::timeout(request_timeout, conn).await {
                Ok(Err(e)) => tracing::debug!(error = %e, "connection ended with an error"),
                Err(_) => tracing::debug!("connection closed: request took too long"),
                Ok(Ok(())) => {}
            }
            drop(permit);
        });
    }
}
