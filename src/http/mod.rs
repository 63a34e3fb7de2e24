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

/// A daemon's `/metrics`: Prometheus' text exposition (format 0.0.4),
/// encoded by `prometheus-client` from a [`Collector`] that reads the
/// daemon's state at each scrape (the counters live in that state, as the
/// status endpoints report them too). Built once per router.
///
/// [`Collector`]: prometheus_client::collector::Collector
pub struct Exposition {
    registry: prometheus_client::registry::Registry,
}

impl std::fmt::Debug for Exposition {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Exposition").finish_non_exhaustive()
    }
}

impl Exposition {
    /// The exposition of `collector`'s families.
    pub fn new(collector: impl prometheus_client::collector::Collector) -> Exposition {
        let mut registry = prometheus_client::registry::Registry::default();
        registry.register_collector(Box::new(collector));
        Exposition { registry }
    }

    /// The text of one scrape.
    pub fn text(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail; a collector that fails leaves
        // what it wrote so far.
        if let Err(e) =
            prometheus_client::encoding::prometheus_text::encode(&mut out, &self.registry)
        {
            tracing::warn!(error = %e, "encoding the metrics failed");
        }
        out
    }

    /// The response to a scrape: the text with its content type.
    pub fn response(&self) -> axum::response::Response {
        (
            [(
                "content-type",
                prometheus_client::encoding::prometheus_text::CONTENT_TYPE,
            )],
            self.text(),
        )
            .into_response()
    }
}

/// Writes metric families into a collector's encoder: each family's name as
/// exposed without the `_total` a counter's samples get, its HELP, its
/// samples.
pub struct Families<'a> {
    encoder: prometheus_client::encoding::DescriptorEncoder<'a>,
}

impl<'a> Families<'a> {
    /// Families written to `encoder`.
    pub fn new(encoder: prometheus_client::encoding::DescriptorEncoder<'a>) -> Families<'a> {
        Families { encoder }
    }

    /// A gauge with one unlabelled sample.
    pub fn gauge(
        &mut self,
        name: &str,
        help: &str,
        value: impl prometheus_client::encoding::EncodeGaugeValue + Send + Sync + std::fmt::Debug,
    ) -> std::fmt::Result {
        use prometheus_client::encoding::EncodeMetric;
        let gauge = prometheus_client::metrics::gauge::ConstGauge::new(value);
        let metric = self
            .encoder
            .encode_descriptor(name, help, None, gauge.metric_type())?;
        gauge.encode(metric)
    }

    /// A counter (`name` without `_total`: its samples are `<name>_total`)
    /// with one unlabelled sample.
    pub fn counter(&mut self, name: &str, help: &str, value: u64) -> std::fmt::Result {
        use prometheus_client::encoding::EncodeMetric;
        let counter = prometheus_client::metrics::counter::ConstCounter::new(value);
        let metric = self
            .encoder
            .encode_descriptor(name, help, None, counter.metric_type())?;
        counter.encode(metric)
    }

    /// A counter with one sample per value of the label `label`.
    pub fn counters(
        &mut self,
        name: &str,
        help: &str,
        label: &str,
        samples: &[(&str, u64)],
    ) -> std::fmt::Result {
        use prometheus_client::encoding::EncodeMetric;
        use prometheus_client::metrics::counter::ConstCounter;
        let kind = ConstCounter::new(0u64).metric_type();
        let mut metric = self.encoder.encode_descriptor(name, help, None, kind)?;
        for (value_of_label, n) in samples {
            ConstCounter::new(*n).encode(metric.encode_family(&[(label, *value_of_label)])?)?;
        }
        Ok(())
    }
}

/// A version as a gauge value: −1 for none (saturating far beyond any real
/// version).
pub fn version_gauge(v: Option<u64>) -> i64 {
    v.map_or(-1, |v| i64::try_from(v).unwrap_or(i64::MAX))
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
