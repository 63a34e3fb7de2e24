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
