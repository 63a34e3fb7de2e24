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

    /// A gauge with one sample per value of the label `label`.
    pub fn gauges(
        &mut self,
        name: &str,
        help: &str,
        label: &str,
        samples: &[(&str, f64)],
    ) -> std::fmt::Result {
        use prometheus_client::encoding::EncodeMetric;
        use prometheus_client::metrics::gauge::ConstGauge;
        let kind = ConstGauge::new(0.0f64).metric_type();
        let mut metric = self.encoder.encode_descriptor(name, help, None, kind)?;
        for (value_of_label, v) in samples {
            ConstGauge::new(*v).encode(metric.encode_family(&[(label, *value_of_label)])?)?;
        }
        Ok(())
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

/// How long a daemon's HTTP surface waits, once the grace period is over,
/// for the requests that could stop to answer (a publish stopped before its
/// commit answers 503 at once) before it abandons what is left.
pub const ABANDON_AFTER: std::time::Duration = std::time::Duration::from_secs(5);

/// A daemon's graceful shutdown as its request handlers see it (mini-redis's
/// `server::run` does the same with a broadcast and a completion channel):
/// once [`serve_hardened`]'s shutdown future completes, the surface is
/// *draining* — every request that arrives is answered 503 `unavailable` —
/// and the requests in flight have a grace period to finish; when it is over
/// the surface *expires*: handlers that can stop without leaving anything
/// half-done do ([`Drain::expired`]) and answer 503, and the others hold the
/// shutdown until they are done ([`Drain::hold`]).
#[derive(Clone, Debug)]
pub struct Drain(std::sync::Arc<DrainState>);

#[derive(Debug)]
struct DrainState {
    draining: std::sync::atomic::AtomicBool,
    expired: tokio::sync::watch::Sender<bool>,
    holds: std::sync::atomic::AtomicUsize,
}

impl Default for Drain {
    fn default() -> Drain {
        Drain(std::sync::Arc::new(DrainState {
            draining: Default::default(),
            expired: tokio::sync::watch::Sender::new(false),
            holds: Default::default(),
        }))
    }
}

/// A request that must finish even after the grace period (a commit under
/// way); the shutdown waits until it is dropped.
#[derive(Debug)]
pub struct Hold(Drain);

impl Drop for Hold {
    fn drop(&mut self) {
        self.0
            .0
            .holds
            .fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
    }
}

impl Drain {
    /// Whether the surface is shutting down (new requests are refused).
    pub fn is_draining(&self) -> bool {
        self.0.draining.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Completes once the grace period is over.
    pub async fn expired(&self) {
        let mut rx = self.0.expired.subscribe();
        let _ = rx.wait_for(|e| *e).await;
    }

    /// Keeps the shutdown waiting until the returned guard is dropped.
    pub fn hold(&self) -> Hold {
        self.0
            .holds
            .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        Hold(self.clone())
    }

    fn holds(&self) -> usize {
        self.0.holds.load(std::sync::atomic::Ordering::Acquire)
    }

    fn start(&self) {
        self.0
            .draining
            .store(true, std::sync::atomic::Ordering::Release);
    }

    fn expire(&self) {
        self.0.expired.send_replace(true);
    }
}

/// The answer to a request that arrives while the daemon shuts down.
fn shutting_down() -> axum::response::Response {
    error_response(&crate::Error::Unavailable(
        "the daemon is shutting down and takes no new requests; retry against its \
         replacement"
            .into(),
    ))
}

/// Connections a daemon serves at once.
pub const MAX_CONNECTIONS: usize = 64;
/// Time a client has to send its request headers.
pub const HEADER_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// Serves `app` on `listener` until `shutdown`, hardened for an open port: at
/// most [`MAX_CONNECTIONS`] connections at once, request headers
/// within [`HEADER_TIMEOUT`] (slowloris), each connection closed
/// after `request_timeout` (one request per connection).
///
/// Then it shuts down gracefully ([`Drain`]): requests that arrive are
/// answered 503 `{"error", "kind": "unavailable"}`, those in flight get
/// `grace` to finish; after it, `drain` expires (handlers stop what they can
/// and answer), and what is still running [`ABANDON_AFTER`] later, unless
/// held, is abandoned — named in the log. Returns when nothing is left.
pub async fn serve_hardened(
    listener: tokio::net::TcpListener,
    app: axum::Router,
    request_timeout: std::time::Duration,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    drain: Drain,
    grace: std::time::Duration,
) -> std::io::Result<()> {
    use hyper_util::rt::{TokioIo, TokioTimer};
    let refusing = drain.clone();
    let app = app.layer(axum::middleware::from_fn(
        move |req: axum::extract::Request, next: axum::middleware::Next| {
            let draining = refusing.is_draining();
            async move {
                if draining {
                    shutting_down()
                } else {
                    next.run(req).await
                }
            }
        },
    ));
    let slots = std::sync::Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    let mut connections = tokio::task::JoinSet::new();
    // The next connection with its slot (`None`: accept failed, try again).
    let accept = async || {
        let permit = slots
            .clone()
            .acquire_owned()
            .await
            .expect("the semaphore is never closed");
        match listener.accept().await {
            Ok((stream, _)) => Some((stream, permit)),
            Err(e) => {
                // Out of descriptors and the like: wait, do not spin.
                tracing::warn!(error = %e, "accept failed");
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                None
            }
        }
    };
    // Serves one connection on a task of its own.
    let serve =
        |connections: &mut tokio::task::JoinSet<()>,
         accepted: Option<(tokio::net::TcpStream, tokio::sync::OwnedSemaphorePermit)>| {
            let Some((stream, permit)) = accepted else {
                return;
            };
            let service = hyper_util::service::TowerToHyperService::new(app.clone());
            connections.spawn(async move {
                let conn = hyper::server::conn::http1::Builder::new()
                    .timer(TokioTimer::new())
                    .header_read_timeout(HEADER_TIMEOUT)
                    .keep_alive(false)
                    .serve_connection(TokioIo::new(stream), service);
                match tokio::time::timeout(request_timeout, conn).await {
                    Ok(Err(e)) => tracing::debug!(error = %e, "connection ended with an error"),
                    Err(_) => tracing::debug!("connection closed: request took too long"),
                    Ok(Ok(())) => {}
                }
                drop(permit);
            });
        };
    tokio::pin!(shutdown);
    loop {
        while connections.try_join_next().is_some() {}
        tokio::select! {
            _ = &mut shutdown => break,
            a = accept() => serve(&mut connections, a),
        }
    }
    // Draining: new requests are answered 503, those in flight may finish.
    drain.start();
    let in_flight = connections.len();
    tracing::info!(
        in_flight,
        grace_seconds = grace.as_secs_f64(),
        "shutting down: new requests are refused (503); waiting for the requests in flight"
    );
    let deadline = tokio::time::Instant::now() + grace;
    loop {
        while connections.try_join_next().is_some() {}
        if connections.is_empty() {
            tracing::info!("every request in flight finished");
            return Ok(());
        }
        tokio::select! {
            _ = tokio::time::sleep_until(deadline) => break,
            _ = connections.join_next() => {}
            a = accept() => serve(&mut connections, a),
        }
    }
    // The grace is over: handlers stop what they can and answer.
    drain.expire();
    tracing::warn!(
        in_flight = connections.len(),
        "shutdown grace period over: stopping the requests still in flight"
    );
    let abandon_at = tokio::time::Instant::now() + ABANDON_AFTER;
    loop {
        while connections.try_join_next().is_some() {}
        if connections.is_empty() {
            return Ok(());
        }
        let held = drain.holds() > 0;
        if !held && tokio::time::Instant::now() >= abandon_at {
            break;
        }
        tokio::select! {
            _ = tokio::time::sleep(std::time::Duration::from_millis(50)) => {}
            _ = connections.join_next() => {}
            a = accept() => serve(&mut connections, a),
        }
    }
    tracing::error!(
        abandoned = connections.len(),
        "shutdown: abandoning requests still in flight (their clients get no answer)"
    );
    connections.abort_all();
    while connections.join_next().await.is_some() {}
    Ok(())
}
