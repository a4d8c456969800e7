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
use std::sync::{Arc, RwLock};

/// Where node-level figures (G4, peers, promotions) come from at scrape time.
pub type FiguresFn = Arc<dyn Fn() -> crate::node::NodeFigures + Send + Sync>;

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
    g4: IntGaugeVec,
    peer_fetches: IntGaugeVec,
    peer_bytes: IntGaugeVec,
    peer_served: IntGaugeVec,
    promotions: IntGaugeVec,
    promote_us: IntGaugeVec,
    promotions_skipped: IntGaugeVec,
    zmq: IntGaugeVec,
    zmq_stats: Arc<RwLock<Option<Arc<crate::zmq::ZmqStats>>>>,
    g3_recovery: IntGaugeVec,
    figures: Arc<RwLock<Option<FiguresFn>>>,
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
            g4: reg(
                &r,
                gv(
                    "kvtier_g4",
                    "G4 write-through and fetch figures (queue_depth, uploads_in_flight, \
                     upload_lag_ms_last, upload_lag_ms_max are gauges; the rest count since start)",
                    &["stat"],
                )?,
            ),
            peer_fetches: reg(
                &r,
                gv(
                    "kvtier_peer_fetches_total",
                    "Peer fetches by outcome (hit, absent, unavailable, corrupt, timeout, skipped)",
                    &["outcome"],
                )?,
            ),
            peer_bytes: reg(
                &r,
                gv(
                    "kvtier_peer_bytes_total",
                    "Block bytes moved between peers, by direction",
                    &["direction"],
                )?,
            ),
            peer_served: reg(
                &r,
                gv(
                    "kvtier_peer_requests_total",
                    "Peer server requests by outcome (all, unauthorized, rejected)",
                    &["outcome"],
                )?,
            ),
            promotions: reg(
                &r,
                gv(
                    "kvtier_promotions_total",
                    "Blocks promoted into G3, by source tier",
                    &["source"],
                )?,
            ),
            promote_us: reg(
                &r,
                gv(
                    "kvtier_promote_microseconds_total",
                    "Time spent promoting, by source and stage (fetch: transfer + verify; store: G3 write)",
                    &["source", "stage"],
                )?,
            ),
            promotions_skipped: reg(
                &r,
                gv(
                    "kvtier_promotions_skipped_total",
                    "Fetched blocks served but not promoted into G3 (promotion queue full or no room), by source tier",
                    &["source"],
                )?,
            ),
            zmq: reg(
                &r,
                gv(
                    "kvtier_events_zmq",
                    "The ZMQ event publisher ([events.zmq]): batches, blocks_stored, skipped_blocks, mismatched_blocks, lagged_events, resyncs, announce_truncated, orphans, replays, replay_snapshots, send_errors",
                    &["what"],
                )?,
            ),
            zmq_stats: Arc::new(RwLock::new(None)),
            g3_recovery: reg(
                &r,
                gv(
                    "kvtier_g3_recovery",
                    "G3 recovery at open and repairs since (index_rebuilt, clean_start: 0/1; \
                     orphans_reindexed, entries_dropped, temp_removed, strays_set_aside, \
                     quarantined_at_open: this open; quarantined, quarantine_trimmed, \
                     renames_undone, orphans_replaced: since start; quarantine_bytes: now)",
                    &["stat"],
                )?,
            ),
            figures: Arc::new(RwLock::new(None)),
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
        self.render_figures();
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

impl Metrics {
    /// Sets where node-level figures come from (kvtierd passes its node).
    pub fn set_figures(&self, f: FiguresFn) {
        if let Ok(mut g) = self.figures.write() {
            *g = Some(f);
        }
    }

    /// Sets the ZMQ publisher whose counters /metrics shows.
    pub fn set_zmq_stats(&self, s: Arc<crate::zmq::ZmqStats>) {
        if let Ok(mut g) = self.zmq_stats.write() {
            *g = Some(s);
        }
    }

    fn render_figures(&self) {
        if let Some(z) = self.zmq_stats.read().ok().and_then(|g| g.clone()) {
            for (what, x) in z.figures() {
                self.zmq.with_label_values(&[what]).set(x as i64);
            }
        }
        let f = match self.figures.read() {
            Ok(g) => g.clone(),
            Err(_) => None,
        };
        let Some(f) = f else { return };
        let n = f();
        let set = |v: &IntGaugeVec, l: &[&str], x: u64| v.with_label_values(l).set(x as i64);
        if let Some(g) = &n.g4 {
            for (k, x) in [
                ("queue_depth", g.upload_queue_depth),
                ("uploads_in_flight", g.uploads_in_flight),
                ("uploads_stored", g.uploads_stored),
                ("uploads_already_present", g.uploads_already_present),
                ("upload_attempt_failures", g.upload_attempt_failures),
                ("uploads_given_up", g.uploads_given_up),
                ("uploads_dropped_queue_full", g.uploads_dropped_queue_full),
                ("uploads_skipped_ephemeral", g.uploads_skipped_ephemeral),
                ("uploads_source_missing", g.uploads_source_missing),
                ("upload_lag_ms_last", g.upload_lag_ms_last),
                ("upload_lag_ms_max", g.upload_lag_ms_max),
                ("fetch_requests", g.fetch_requests),
                ("fetch_hits", g.fetch_hits),
                ("fetch_absent", g.fetch_absent),
                ("fetch_corrupt", g.fetch_corrupt),
                ("fetch_unavailable", g.fetch_unavailable),
                ("exists_heads", g.exists_heads),
                ("sweep_deleted", g.sweep_deleted),
                ("breaker_open", g.breaker_open),
                ("breaker_opened", g.breaker_opened),
                ("breaker_rejected", g.breaker_rejected),
                ("fetch_rereads", g.fetch_rereads),
                ("fetch_corrupt_deleted", g.fetch_corrupt_deleted),
                ("fetch_refused_size", g.fetch_refused_size),
                ("fetch_body_failures", g.fetch_body_failures),
                ("startup_check_ok", g.startup_check_ok),
                ("enqueued", n.g4_enqueued),
            ] {
                set(&self.g4, &[k], x);
            }
        }
        if let Some(p) = &n.peer {
            for (k, x) in [
                ("hit", p.hits),
                ("absent", p.absent),
                ("unavailable", p.unavailable),
                ("corrupt", p.corrupt),
                ("timeout", p.timeout),
                ("skipped", p.skipped),
            ] {
                set(&self.peer_fetches, &[k], x);
            }
            set(&self.peer_bytes, &["received"], p.bytes);
        }
        if let Some(s) = &n.peer_served {
            set(&self.peer_bytes, &["sent"], s.bytes_sent);
            set(&self.peer_served, &["all"], s.requests);
            set(&self.peer_served, &["unauthorized"], s.unauthorized);
            set(&self.peer_served, &["rejected"], s.rejected);
        }
        for (k, x) in &n.g3_recovery {
            set(&self.g3_recovery, &[k], *x);
        }
        for (src, p) in [("peer", n.promoted_from_peer), ("g4", n.promoted_from_g4)] {
            set(&self.promotions, &[src], p.count);
            set(&self.promote_us, &[src, "fetch"], p.fetch_us);
            set(&self.promote_us, &[src, "store"], p.store_us);
            set(&self.promotions_skipped, &[src], p.skipped);
        }
    }
}

/// Connections the metrics endpoint serves at once.
pub const METRICS_CONNECTIONS_MAX: usize = 64;

static ACCEPT_WARN: crate::log_limit::LogLimit = crate::log_limit::LogLimit::new(1000);

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
    let conns = Arc::new(tokio::sync::Semaphore::new(METRICS_CONNECTIONS_MAX));
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = shutdown.changed() => return,
        };
        let stream = match accepted {
            Ok((stream, _)) => stream,
            Err(e) => {
                // EMFILE and friends: back off instead of spinning on a
                // listener that stays readable, and say so once a second.
                crate::warn_limited!(ACCEPT_WARN, "metrics accept failed: {e}");
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                continue;
            }
        };
        // A scraper or a flood holds at most this many connections; the
        // rest are closed at once, so fds stay bounded.
        let Ok(permit) = conns.clone().try_acquire_owned() else {
            drop(stream);
            continue;
        };
        let metrics = metrics.clone();
        let backend = backend.clone();
        tokio::spawn(async move {
            let _permit = permit;
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
                            "/healthz" => {
                                // Degraded is still 200: the node serves
                                // (G3, misses for the rest); the body says
                                // what is wrong, one line each.
                                let b = backend.clone();
                                let problems = tokio::task::spawn_blocking(move || b.health())
                                    .await
                                    .unwrap_or_default();
                                let text = if problems.is_empty() {
                                    "ok\n".to_string()
                                } else {
                                    let mut t = String::from("degraded\n");
                                    for p in problems {
                                        t.push_str(&p);
                                        t.push('\n');
                                    }
                                    t
                                };
                                (StatusCode::OK, "text/plain", text)
                            }
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

    /// G3's recovery counters reach /metrics: a stray file set aside and a
    /// damaged index rebuilt at open show up as their stats.
    #[test]
    fn exports_g3_recovery_counters() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = crate::g3::G3Config::new(dir.path(), 1 << 26);
        let ns_dir = dir.path().join("blocks").join("00".repeat(16));
        std::fs::create_dir_all(&ns_dir).unwrap();
        std::fs::write(ns_dir.join("stray"), b"not a shard").unwrap();
        std::fs::write(dir.path().join("index.redb"), vec![0x5a; 8192]).unwrap();
        let g3 = crate::g3::G3Store::open(cfg, Box::new(crate::policy::Lru::new())).unwrap();
        let m = Metrics::new().unwrap();
        let g = Arc::clone(&g3);
        m.set_figures(Arc::new(move || crate::node::NodeFigures {
            g3_recovery: g.recovery_figures(),
            ..Default::default()
        }));
        let b = MemBackend::new(MemLimits::default(), std::env::temp_dir());
        let text = m.render(&b);
        for line in [
            "kvtier_g3_recovery{stat=\"index_rebuilt\"} 1",
            "kvtier_g3_recovery{stat=\"strays_set_aside\"} 1",
            "kvtier_g3_recovery{stat=\"orphans_reindexed\"} 0",
            "kvtier_g3_recovery{stat=\"renames_undone\"} 0",
            "kvtier_g3_recovery{stat=\"quarantine_bytes\"}",
        ] {
            assert!(text.contains(line), "{line} missing in\n{text}");
        }
    }
}
