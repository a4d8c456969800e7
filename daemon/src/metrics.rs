//! Prometheus metrics and the `/metrics` + `/healthz` HTTP endpoint.
//!
//! Counters are bumped by the server as requests run; occupancy gauges
//! (blocks and bytes per tier, leases, evictions, quarantined) are read from
//! the backend at scrape time so they can never drift from the store.

use crate::server::backend::Backend;
use prometheus::{
    Encoder, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts,
    Registry, TextEncoder,
};
use std::sync::Arc;

/// Every metric kvtierd exports.
#[derive(Clone)]
pub struct Metrics {
    registry: Registry,
    /// Requests by op.
    pub requests: IntCounterVec,
    /// Errors by kind (malformed, too_large, timeout, io, storage, corrupt,
    /// no_space, limit, busy).
    pub errors: IntCounterVec,
    /// Latency per op.
    pub latency: HistogramVec,
    /// Blocks served or found, by tier (lookup prefix blocks, onboard hits).
    pub hits: IntCounterVec,
    /// Blocks asked for and not served, by reason (absent, corrupt,
    /// unavailable).
    pub misses: IntCounterVec,
    /// Payload bytes offloaded (newly stored).
    pub offload_bytes: IntCounter,
    /// Payload bytes onboarded.
    pub onboard_bytes: IntCounter,
    /// Open connections.
    pub connections: IntGauge,
    /// Queue depths (in_flight_requests, event_subscribers).
    pub queue_depth: IntGaugeVec,
    blocks: IntGaugeVec,
    bytes: IntGaugeVec,
    capacity: IntGaugeVec,
    evictions: IntGauge,
    quarantined: IntGauge,
    leases: IntGauge,
    pins: IntGauge,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Metrics")
    }
}

fn reg<T: prometheus::core::Collector + Clone + 'static>(r: &Registry, m: T) -> T {
    // Names are unique constants below; a duplicate would be a programming
    // error caught by the unit test.
    let _ = r.register(Box::new(m.clone()));
    m
}

impl Metrics {
    /// Registers every metric in a fresh registry.
    pub fn new() -> prometheus::Result<Self> {
        let r = Registry::new();
        let cv = |n: &str, h: &str, l: &[&str]| IntCounterVec::new(Opts::new(n, h), l);
        let gv = |n: &str, h: &str, l: &[&str]| IntGaugeVec::new(Opts::new(n, h), l);
        Ok(Metrics {
            requests: reg(&r, cv("kvtier_requests_total", "Requests by op", &["op"])?),
            errors: reg(&r, cv("kvtier_errors_total", "Errors by kind", &["kind"])?),
            latency: reg(
                &r,
                HistogramVec::new(
                    HistogramOpts::new("kvtier_op_latency_seconds", "Request latency by op")
                        .buckets(vec![
                            10e-6, 25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3,
                            25e-3, 50e-3, 100e-3, 250e-3, 1.0, 5.0,
                        ]),
                    &["op"],
                )?,
            ),
            hits: reg(
                &r,
                cv("kvtier_hits_total", "Blocks found, by tier", &["tier"])?,
            ),
            misses: reg(
                &r,
                cv(
                    "kvtier_misses_total",
                    "Blocks not served, by reason",
                    &["reason"],
                )?,
            ),
            offload_bytes: reg(
                &r,
                IntCounter::new("kvtier_offload_bytes_total", "Payload bytes newly stored")?,
            ),
            onboard_bytes: reg(
                &r,
                IntCounter::new("kvtier_onboard_bytes_total", "Payload bytes onboarded")?,
            ),
            connections: reg(
                &r,
                IntGauge::new("kvtier_connections", "Open client connections")?,
            ),
            queue_depth: reg(&r, gv("kvtier_queue_depth", "Queue depths", &["queue"])?),
            blocks: reg(
                &r,
                gv("kvtier_blocks", "Blocks stored, by tier", &["tier"])?,
            ),
            bytes: reg(&r, gv("kvtier_bytes", "Bytes stored, by tier", &["tier"])?),
            capacity: reg(
                &r,
                gv(
                    "kvtier_capacity_bytes",
                    "Configured capacity, by tier",
                    &["tier"],
                )?,
            ),
            evictions: reg(
                &r,
                IntGauge::new("kvtier_evictions_total", "Blocks evicted since start")?,
            ),
            quarantined: reg(
                &r,
                IntGauge::new("kvtier_quarantined_total", "Corrupt blocks quarantined")?,
            ),
            leases: reg(&r, IntGauge::new("kvtier_leases_held", "Leases held")?),
            pins: reg(&r, IntGauge::new("kvtier_pins_held", "Pins held")?),
            registry: r,
        })
    }

    /// Refreshes the backend gauges and renders the text exposition format.
    pub fn render(&self, backend: &dyn Backend) -> String {
        let s = backend.stats();
        for t in &s.tiers {
            let n = t.tier.name();
            self.blocks.with_label_values(&[n]).set(t.blocks as i64);
            self.bytes.with_label_values(&[n]).set(t.bytes as i64);
            self.capacity
                .with_label_values(&[n])
                .set(t.capacity_bytes as i64);
        }
        self.evictions.set(s.evictions as i64);
        self.quarantined.set(s.quarantined as i64);
        self.leases.set(s.leases_held as i64);
        self.pins.set(s.pins_held as i64);
        let mut buf = Vec::new();
        if TextEncoder::new()
            .encode(&self.registry.gather(), &mut buf)
            .is_err()
        {
            return String::new();
        }
        String::from_utf8(buf).unwrap_or_default()
    }
}

/// Serves `/metrics` and `/healthz` on `listener` until `shutdown` fires.
pub async fn serve(
    listener: tokio::net::TcpListener,
    metrics: Metrics,
    backend: Arc<dyn Backend>,
    mut shutdown: tokio::sync::watch::Receiver<bool>,
) {
    use http_body_util::Full;
    use hyper::body::Bytes;
    use hyper::{Response, StatusCode};
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = shutdown.changed() => return,
        };
        let Ok((stream, _)) = accepted else { continue };
        let metrics = metrics.clone();
        let backend = backend.clone();
        tokio::spawn(async move {
            let svc =
                hyper::service::service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
                    let metrics = metrics.clone();
                    let backend = backend.clone();
                    async move {
                        let (status, ctype, body) = match req.uri().path() {
                            "/metrics" => {
                                let b = backend.clone();
                                let m = metrics.clone();
                                let text = tokio::task::spawn_blocking(move || m.render(&*b))
                                    .await
                                    .unwrap_or_default();
                                (StatusCode::OK, "text/plain; version=0.0.4", text)
                            }
                            "/healthz" => (StatusCode::OK, "text/plain", "ok\n".to_string()),
                            _ => (
                                StatusCode::NOT_FOUND,
                                "text/plain",
                                "not found\n".to_string(),
                            ),
                        };
                        let mut resp = Response::new(Full::new(Bytes::from(body)));
                        *resp.status_mut() = status;
                        if let Ok(v) = hyper::header::HeaderValue::from_str(ctype) {
                            resp.headers_mut().insert(hyper::header::CONTENT_TYPE, v);
                        }
                        Ok::<_, std::convert::Infallible>(resp)
                    }
                });
            let io = hyper_util::rt::TokioIo::new(stream);
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(std::time::Duration::from_secs(5))
                .serve_connection(io, svc);
            let _ = tokio::time::timeout(std::time::Duration::from_secs(30), conn).await;
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::server::{MemBackend, MemLimits};

    #[test]
    fn renders_every_family() {
        let m = Metrics::new().unwrap();
        m.requests.with_label_values(&["lookup"]).inc();
        let b = MemBackend::new(MemLimits::default(), std::env::temp_dir());
        let text = m.render(&b);
        for name in [
            "kvtier_requests_total",
            "kvtier_blocks",
            "kvtier_leases_held",
            "kvtier_evictions_total",
        ] {
            assert!(text.contains(name), "{name} missing in\n{text}");
        }
    }
}
