//! Prometheus metrics and the `/metrics` + `/healthz` HTTP endpoint.
//!
//! Conventions (checked by tests/e2e_metrics.rs with a Prometheus text
//! parser): counters end in `_total`; units are base units at the end of
//! the name (`_seconds`, `_bytes`), never ms or us; one family per meaning,
//! its variants as labels; no family mixes counters and gauges; every
//! family has HELP.
//!
//! Counters are bumped by the server as requests run; occupancy gauges
//! (blocks and bytes per tier, leases, pins) are read from the backend at
//! scrape time so they can never drift from the store. Figures other
//! parts keep as plain atomics (G4, peers, promotions, the mount, the event
//! bus, ZMQ, G3 recovery) are copied in at scrape time: a counter is
//! advanced to the source's value, so it stays a true Prometheus counter.

use crate::base::backend::Backend;
use crate::base::events::EventBus;
use kvtier_client::Tier;
use prometheus::{
    CounterVec, Encoder, GaugeVec, HistogramOpts, HistogramVec, IntCounter, IntCounterVec,
    IntGauge, IntGaugeVec, Opts, Registry, TextEncoder,
};
use std::collections::HashMap;
use std::sync::{Arc, RwLock};

/// The `reason` label values of `kvtier_misses_total`: `absent` (no tier
/// holds the block), `corrupt` (it failed verification), `unavailable` (a
/// tier that may hold it could not answer in time: G4 down or late).
pub const MISS_REASONS: [&str; 3] = ["absent", "corrupt", "unavailable"];

/// Where node-level figures (G4, peers, promotions) come from at scrape time.
pub type FiguresFn = Arc<dyn Fn() -> crate::node::NodeFigures + Send + Sync>;

/// Where the mount's figures come from at scrape time.
pub type MountFiguresFn = Arc<dyn Fn() -> MountFigures + Send + Sync>;

/// What the mount did since start (`kvtier_mount_*`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MountFigures {
    /// The fs adapter's counters.
    pub fs: kvtier_fs::Counters,
    /// Opens refused because the block failed verification.
    pub verify_failures: u64,
}

/// Families filled at scrape time: (name, help, labels). Counters.
const SCRAPED_COUNTERS: &[(&str, &str, &[&str])] = &[
    ("kvtier_evictions_total", "Blocks evicted from G3 (capacity pressure or request) since start", &[]),
    ("kvtier_quarantined_total", "Blocks found corrupt and quarantined since start", &[]),
    ("kvtier_events_published_total", "KV events published on the event bus since start", &[]),
    ("kvtier_events_dynamo_skipped_blocks_total", "Stored blocks of dynamo-mode namespaces sent without routing facts (kvtier's event form only)", &[]),
    // G4 write-through.
    ("kvtier_g4_uploads_enqueued_total", "G4 write-through jobs queued by this node", &[]),
    ("kvtier_g4_uploads_total", "G4 upload jobs finished, by outcome (stored, already_present, given_up, dropped_queue_full, skipped_ephemeral, source_missing, source_corrupt)", &["outcome"]),
    ("kvtier_g4_upload_attempt_failures_total", "Failed G4 upload attempts (each retry counts)", &[]),
    ("kvtier_g4_uploaded_bytes_total", "Bytes (whole block files) newly written to G4 by this node", &[]),
    // G4 fetch.
    ("kvtier_g4_fetch_requests_total", "G4 fetch calls (onboard fall-through)", &[]),
    ("kvtier_g4_fetches_total", "G4 fetches by outcome (hit, absent, corrupt, unavailable)", &["outcome"]),
    ("kvtier_g4_gets_total", "GET requests sent to G4 (single-flight: at most one per block at a time)", &[]),
    ("kvtier_g4_fetch_rereads_total", "G4 objects re-read after a failed verification", &[]),
    ("kvtier_g4_corrupt_deleted_total", "Corrupt G4 objects deleted (same ETag read corrupt twice)", &[]),
    ("kvtier_g4_fetch_refused_size_total", "G4 objects refused by size before buffering", &[]),
    ("kvtier_g4_fetch_body_failures_total", "G4 bodies that ended early, stalled or broke (a miss, never a delete)", &[]),
    ("kvtier_g4_exists_checks_total", "G4 existence answers, by source (cache, head)", &["source"]),
    // G4 lifecycle and breaker.
    ("kvtier_g4_sweeps_total", "G4 sweeper runs", &[]),
    ("kvtier_g4_swept_blocks_total", "G4 objects deleted by the sweeper (capacity, TTL)", &[]),
    ("kvtier_g4_swept_bytes_total", "G4 bytes deleted by the sweeper", &[]),
    ("kvtier_g4_lifecycle_conflicts_total", "G4 sweeps that deleted nothing because another node's lifecycle view disagreed", &[]),
    ("kvtier_g4_breaker_opened_total", "Times the G4 circuit breaker opened", &[]),
    ("kvtier_g4_breaker_rejected_total", "G4 calls refused by the open breaker (no request sent)", &[]),
    ("kvtier_g4_probes_total", "Active G4 probes sent while the breaker was open or the start-up check failing", &[]),
    ("kvtier_g4_recoveries_total", "Times G4 recovered by itself (breaker closed, start-up check passed after failing)", &[]),
    ("kvtier_g4_backlog_requeued_total", "Blocks the backlog scan re-queued for upload (lost to an outage, a full queue or a restart)", &[]),
    ("kvtier_g4_backlog_scans_total", "G3 scans for blocks not yet safe in G4", &[]),
    ("kvtier_g4_deleted_blocks_total", "G4 objects this node deleted (evict, sweeper, proven corruption)", &[]),
    ("kvtier_g4_fetch_budget_refused_total", "G4 fetches missed because the shared fetch byte budget (fetch_buffer_bytes_max) stayed full", &[]),
    // Peers.
    ("kvtier_peer_fetches_total", "Peer fetches by outcome (hit, absent, unavailable, corrupt, timeout, skipped)", &["outcome"]),
    ("kvtier_peer_bytes_total", "Block bytes moved between peers, by direction (received, sent)", &["direction"]),
    ("kvtier_peer_requests_total", "Peer server requests by outcome (all, unauthorized, rejected)", &["outcome"]),
    ("kvtier_peer_holdings_refreshes_total", "Peer holdings digests fetched, by outcome (ok, failed)", &["outcome"]),
    ("kvtier_peer_lookup_answers_total", "Per-peer lookup answers, by source (digest_held, digest_not_held, probe)", &["source"]),
    ("kvtier_peer_holdings_false_positives_total", "Fetches of blocks a peer's digest listed that the peer did not have (a miss at fetch)", &[]),
    // Promotions.
    ("kvtier_promotions_total", "Blocks promoted into G3, by source tier", &["source"]),
    ("kvtier_promotions_skipped_total", "Fetched blocks served but not promoted into G3 (promotion queue full or no room), by source tier", &["source"]),
    // Prefetch.
    ("kvtier_prefetch_blocks_total", "Blocks asked for by prefetches, by outcome (queued, already_local, fetched, missed, expired, superseded, refused)", &["outcome"]),
    // G3 repairs since start.
    ("kvtier_g3_quarantine_trimmed_total", "Quarantined G3 entries deleted to stay within the quarantine bounds", &[]),
    ("kvtier_g3_renames_undone_total", "G3 renames undone after a failed group commit", &[]),
    ("kvtier_g3_orphans_replaced_total", "Unindexed G3 block files replaced by a fresh offload", &[]),
    ("kvtier_g3_evicted_before_upload_total", "G3 blocks evicted before their G4 upload while write-through was on (G4 has no copy)", &[]),
    ("kvtier_g3_unreachable_removed_total", "G3 blocks removed because their parent was removed by force or was gone at open", &[]),
    // The G3 recycle pool (g3/recycle.rs).
    ("kvtier_g3_recycled_writes_total", "G3 offloads that overwrote a pooled (evicted) file in place", &[]),
    ("kvtier_g3_recycle_retired_total", "Evicted G3 block files kept in recycle/ for reuse", &[]),
    ("kvtier_g3_recycle_dropped_total", "Pooled G3 files unlinked (room needed, the bound, a refused lease)", &[]),
    ("kvtier_g3_empty_dirs_removed_total", "Empty G3 shard and namespace directories removed", &[]),
    ("kvtier_g3_index_reopens_total", "Times G3's index was opened again after an I/O error (a full disk)", &[]),
    ("kvtier_g3_slot_writes_total", "G3 offloads written into a slab slot (g3/slots.rs)", &[]),
    ("kvtier_g3_batch_reads_total", "G3 onboard hits read together with the rest of their request on its connection's thread (g3/read_batch.rs)", &[]),
    // The mount.
    ("kvtier_mount_opens_total", "Opens of block files on the mount, by mode (passthrough, fallback)", &["mode"]),
    ("kvtier_mount_fallback_reads_total", "Read requests on the mount answered by the daemon (not passthrough)", &[]),
    ("kvtier_mount_fallback_read_bytes_total", "Bytes read through the mount answered by the daemon", &[]),
    ("kvtier_mount_imports_total", "Block files written into the mount, by outcome (stored, refused)", &["outcome"]),
    ("kvtier_mount_removes_total", "Blocks removed with rm on the mount", &[]),
    ("kvtier_mount_verify_failures_total", "Opens on the mount refused because the block failed verification", &[]),
    // The ZMQ publisher ([events.zmq]).
    ("kvtier_events_zmq_batches_total", "ZMQ KVEventBatch messages published", &[]),
    ("kvtier_events_zmq_blocks_total", "Blocks seen by the ZMQ publisher, by outcome (stored: announced, skipped: no routing facts, mismatched: facts disagree)", &["outcome"]),
    ("kvtier_events_zmq_lagged_events_total", "Bus events the ZMQ publisher lost while behind", &[]),
    ("kvtier_events_zmq_resyncs_total", "ZMQ publisher restarts with AllBlocksCleared and the holdings", &[]),
    ("kvtier_events_zmq_announce_truncated_total", "Holdings announcements cut at their size bound", &[]),
    ("kvtier_events_zmq_orphans_total", "Held blocks left out of an announcement (parent not held)", &[]),
    ("kvtier_events_zmq_heartbeats_total", "Empty ZMQ batches sent while idle (events.zmq.heartbeat_ms)", &[]),
    ("kvtier_events_zmq_replays_total", "Replay requests answered", &[]),
    ("kvtier_events_zmq_replay_snapshots_total", "Replays answered with a holdings snapshot (asked-for batches no longer kept)", &[]),
    ("kvtier_events_zmq_send_errors_total", "ZMQ sends that failed", &[]),
];

/// Families filled at scrape time: (name, help, labels). Gauges.
const SCRAPED_GAUGES: &[(&str, &str, &[&str])] = &[
    ("kvtier_peer_holdings_peers", "Peers with a usable holdings digest", &[]),
    ("kvtier_peer_holdings_bytes", "Encoded bytes of the usable peer holdings digests held", &[]),
    ("kvtier_blocks", "Blocks stored, by tier (g4: last listing plus this node's uploads since; absent until the first listing)", &["tier"]),
    ("kvtier_bytes", "Bytes stored (block files), by tier (g4 as kvtier_blocks)", &["tier"]),
    ("kvtier_capacity_bytes", "Configured capacity, by tier (0: unbounded)", &["tier"]),
    ("kvtier_leases_held", "Leases held now", &[]),
    ("kvtier_pins_held", "Blocks pinned now (client pins, setfattr on the mount, pinned hints)", &[]),
    ("kvtier_backend_info", "The tiers this node serves from (value 1; `backend` as in `kvtier stats`)", &["backend"]),
    ("kvtier_events_dynamo_worker_info", "The Dynamo worker id events are stamped with (value 1)", &["worker_id"]),
    ("kvtier_g4_upload_queue_depth", "G4 upload jobs waiting in the queue", &[]),
    ("kvtier_g4_uploads_in_flight", "G4 uploads in flight", &[]),
    ("kvtier_g4_breaker_open", "1 while the G4 circuit breaker is open (G4 calls refused)", &[]),
    ("kvtier_g4_startup_check", "The G4 start-up check, 1 for its state (passed, failed, not_run)", &["state"]),
    ("kvtier_g4_lifecycle_conflict", "1 while the last G4 sweep found the bucket's lifecycle not agreed by every node (it deleted nothing)", &[]),
    ("kvtier_g4_listing_truncated", "1 when the last G4 listing stopped at sweep_list_max (kvtier_blocks{tier=\"g4\"} is a floor)", &[]),
    ("kvtier_g4_backlog_blocks", "G3 blocks not yet safe in G4 that admission would upload, at the last backlog scan", &[]),
    ("kvtier_g4_backlog_bytes", "Bytes (block files) of kvtier_g4_backlog_blocks", &[]),
    ("kvtier_g4_backlog_oldest_age_seconds", "Age of the oldest block in kvtier_g4_backlog_blocks, whole seconds (0: none)", &[]),
    ("kvtier_g4_fetch_buffered_bytes", "Body bytes G4 fetches buffer now (bounded by fetch_buffer_bytes_max)", &[]),
    ("kvtier_g4_fetch_buffered_peak_bytes", "The most body bytes G4 fetches buffered at once since start", &[]),
    ("kvtier_g3_recovered_at_open", "What G3's recovery found at this open (orphans_reindexed, entries_dropped, temp_removed, strays_set_aside, quarantined)", &["found"]),
    ("kvtier_g3_index_rebuilt_at_open", "1 when G3's index was rebuilt from the files at this open", &[]),
    ("kvtier_g3_clean_start", "1 when G3 found a clean shutdown at this open", &[]),
    ("kvtier_g3_quarantine_bytes", "Bytes in G3's quarantine/ now", &[]),
    ("kvtier_g3_disk_full", "1 while the filesystem under G3 is full (the index's reserve in use; offloads answer no_space)", &[]),
    ("kvtier_g3_recycle_pool_bytes", "Bytes of evicted files in G3's recycle/ now (bounded by recycle_max, counted against capacity)", &[]),
    ("kvtier_g3_recycle_pool_files", "Evicted files in G3's recycle/ now", &[]),
    ("kvtier_g3_slots_used", "G3 slab slots holding a block or being written now", &[]),
    ("kvtier_g3_slots_free", "G3 slab slots free with their bytes kept for reuse now", &[]),
    ("kvtier_g3_slabs", "G3 slab files open (one per block file length)", &[]),
    ("kvtier_g3_dir_bytes", "Bytes the directories under G3's blocks/ are charged against capacity (4 KiB each)", &[]),
    ("kvtier_g3_slot_pool_bytes", "Bytes of free G3 slab slots kept for reuse (counted against capacity)", &[]),
    ("kvtier_prefetch_waiting_blocks", "Prefetched blocks waiting for a prefetch thread", &[]),
    ("kvtier_mount_passthrough_active", "1 while new opens on the mount use FUSE passthrough", &[]),
];

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
    counters: Arc<HashMap<&'static str, IntCounterVec>>,
    gauges: Arc<HashMap<&'static str, IntGaugeVec>>,
    promote_seconds: CounterVec,
    upload_lag_seconds: GaugeVec,
    holdings_age_seconds: prometheus::Gauge,
    zmq_stats: Arc<RwLock<Option<Arc<crate::edges::zmq::ZmqStats>>>>,
    figures: Arc<RwLock<Option<FiguresFn>>>,
    mount: Arc<RwLock<Option<MountFiguresFn>>>,
    bus: Arc<RwLock<Option<EventBus>>>,
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
        let mut counters = HashMap::new();
        for (n, h, l) in SCRAPED_COUNTERS {
            counters.insert(*n, reg(&r, cv(n, h, l)?));
        }
        let mut gauges = HashMap::new();
        for (n, h, l) in SCRAPED_GAUGES {
            gauges.insert(*n, reg(&r, gv(n, h, l)?));
        }
        let m = Metrics {
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
            queue_depth: reg(
                &r,
                gv(
                    "kvtier_queue_depth",
                    "Requests in flight and event subscribers now, by queue",
                    &["queue"],
                )?,
            ),
            promote_seconds: reg(
                &r,
                CounterVec::new(
                    Opts::new(
                        "kvtier_promote_seconds_total",
                        "Time spent promoting, by source and stage (fetch: transfer + verify; store: G3 write)",
                    ),
                    &["source", "stage"],
                )?,
            ),
            upload_lag_seconds: reg(
                &r,
                GaugeVec::new(
                    Opts::new(
                        "kvtier_g4_upload_lag_seconds",
                        "Enqueue-to-stored time of G4 uploads, by which (last: the last finished, max: the largest since start)",
                    ),
                    &["which"],
                )?,
            ),
            holdings_age_seconds: reg(
                &r,
                prometheus::Gauge::new(
                    "kvtier_peer_holdings_age_seconds",
                    "Age of the oldest usable peer holdings digest, seconds since it was fetched",
                )?,
            ),
            counters: Arc::new(counters),
            gauges: Arc::new(gauges),
            zmq_stats: Arc::new(RwLock::new(None)),
            figures: Arc::new(RwLock::new(None)),
            mount: Arc::new(RwLock::new(None)),
            bus: Arc::new(RwLock::new(None)),
            registry: r,
        };
        m.preset();
        Ok(m)
    }

    /// Every hit and miss series exists from start, at 0: `rate()` and
    /// alerts on a series that appears only with its first event see
    /// nothing until then (issue 30). And the process's own figures (CPU
    /// seconds, resident memory, open and maximum file descriptors,
    /// threads, start time) as `process_*`.
    fn preset(&self) {
        for t in [Tier::G3, Tier::Peer, Tier::G4] {
            self.hits.with_label_values(&[t.name()]);
        }
        for reason in MISS_REASONS {
            self.misses.with_label_values(&[reason]);
        }
        #[cfg(target_os = "linux")]
        let _ = self.registry.register(Box::new(
            prometheus::process_collector::ProcessCollector::for_self(),
        ));
    }

    /// Advances scraped counter `name{labels}` to `x` (the source only
    /// grows; a smaller value, e.g. a source replaced, is ignored).
    fn count(&self, name: &str, labels: &[&str], x: u64) {
        if let Some(c) = self.counters.get(name) {
            let c = c.with_label_values(labels);
            let cur = c.get();
            if x > cur {
                c.inc_by(x - cur);
            }
        }
    }

    /// The peer holdings digest families (peer/holdings.rs).
    fn render_holdings(&self, p: &crate::tiers::peer::PeerMetricsSnapshot) {
        let c = "kvtier_peer_holdings_refreshes_total";
        self.count(c, &["ok"], p.holdings_refreshed);
        self.count(c, &["failed"], p.holdings_failed);
        let c = "kvtier_peer_lookup_answers_total";
        self.count(c, &["digest_held"], p.lookup_digest_held);
        self.count(c, &["digest_not_held"], p.lookup_digest_not_held);
        self.count(c, &["probe"], p.lookup_probes);
        let c = "kvtier_peer_holdings_false_positives_total";
        self.count(c, &[], p.holdings_false_positives);
        self.gauge("kvtier_peer_holdings_peers", &[], p.holdings_peers);
        self.gauge("kvtier_peer_holdings_bytes", &[], p.holdings_bytes);
        self.holdings_age_seconds
            .set(p.holdings_age_ms_max as f64 / 1e3);
    }

    /// Sets scraped gauge `name{labels}` to `x`.
    fn gauge(&self, name: &str, labels: &[&str], x: u64) {
        if let Some(g) = self.gauges.get(name) {
            g.with_label_values(labels).set(x as i64);
        }
    }

    /// Refreshes the backend gauges and renders the text exposition format.
    pub fn render(&self, backend: &dyn Backend) -> String {
        let s = backend.stats();
        self.gauge("kvtier_backend_info", &[backend.name()], 1);
        for t in &s.tiers {
            let n = t.tier.name();
            if t.known {
                self.gauge("kvtier_blocks", &[n], t.blocks);
                self.gauge("kvtier_bytes", &[n], t.bytes);
            }
            self.gauge("kvtier_capacity_bytes", &[n], t.capacity_bytes);
        }
        self.count("kvtier_evictions_total", &[], s.evictions);
        self.count("kvtier_quarantined_total", &[], s.quarantined);
        self.gauge("kvtier_leases_held", &[], s.leases_held);
        self.gauge("kvtier_pins_held", &[], s.pins_held);
        self.render_bus();
        self.render_mount();
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

    /// Sets where the mount's figures come from (kvtierd with `--mount`).
    pub fn set_mount(&self, f: MountFiguresFn) {
        if let Ok(mut g) = self.mount.write() {
            *g = Some(f);
        }
    }

    /// Adds a collector whose families are built at each scrape (the
    /// server's per-namespace `kvtier_client_*` families). One whose names
    /// are registered already is logged and left out.
    pub fn register_collector(&self, c: Box<dyn prometheus::core::Collector>) {
        if let Err(e) = self.registry.register(c) {
            tracing::warn!(error = %e, "a metrics collector was not registered");
        }
    }

    /// Sets the event bus whose figures /metrics shows (the server does).
    pub fn set_bus(&self, bus: EventBus) {
        if let Ok(mut g) = self.bus.write() {
            *g = Some(bus);
        }
    }

    /// Sets the ZMQ publisher whose counters /metrics shows.
    pub fn set_zmq_stats(&self, s: Arc<crate::edges::zmq::ZmqStats>) {
        if let Ok(mut g) = self.zmq_stats.write() {
            *g = Some(s);
        }
    }

    fn render_bus(&self) {
        let Some(bus) = self.bus.read().ok().and_then(|g| g.clone()) else {
            return;
        };
        self.count("kvtier_events_published_total", &[], bus.published());
        self.count(
            "kvtier_events_dynamo_skipped_blocks_total",
            &[],
            bus.dynamo_skipped_blocks(),
        );
        if let Some(w) = bus.dynamo_worker() {
            self.gauge("kvtier_events_dynamo_worker_info", &[&w.to_string()], 1);
        }
    }

    fn render_mount(&self) {
        let Some(f) = self.mount.read().ok().and_then(|g| g.clone()) else {
            return;
        };
        let m = f();
        let c = &m.fs;
        self.count(
            "kvtier_mount_opens_total",
            &["passthrough"],
            c.passthrough_opens,
        );
        self.count("kvtier_mount_opens_total", &["fallback"], c.fallback_opens);
        self.count("kvtier_mount_fallback_reads_total", &[], c.fallback_reads);
        self.count(
            "kvtier_mount_fallback_read_bytes_total",
            &[],
            c.fallback_read_bytes,
        );
        self.count("kvtier_mount_imports_total", &["stored"], c.imports);
        self.count(
            "kvtier_mount_imports_total",
            &["refused"],
            c.imports_refused,
        );
        self.count("kvtier_mount_removes_total", &[], c.removes);
        self.count("kvtier_mount_verify_failures_total", &[], m.verify_failures);
        self.gauge(
            "kvtier_mount_passthrough_active",
            &[],
            u64::from(c.passthrough_active),
        );
    }

    fn render_zmq(&self) {
        let Some(z) = self.zmq_stats.read().ok().and_then(|g| g.clone()) else {
            return;
        };
        for (what, x) in z.figures() {
            match what {
                "blocks_stored" => self.count("kvtier_events_zmq_blocks_total", &["stored"], x),
                "skipped_blocks" => self.count("kvtier_events_zmq_blocks_total", &["skipped"], x),
                "mismatched_blocks" => {
                    self.count("kvtier_events_zmq_blocks_total", &["mismatched"], x)
                }
                other => self.count(&format!("kvtier_events_zmq_{other}_total"), &[], x),
            }
        }
    }

    fn render_figures(&self) {
        self.render_zmq();
        let f = match self.figures.read() {
            Ok(g) => g.clone(),
            Err(_) => None,
        };
        let Some(f) = f else { return };
        let n = f();
        if let Some(g) = &n.g4 {
            self.render_g4(g, n.g4_enqueued);
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
                self.count("kvtier_peer_fetches_total", &[k], x);
            }
            self.count("kvtier_peer_bytes_total", &["received"], p.bytes);
            self.render_holdings(p);
        }
        if let Some(s) = &n.peer_served {
            self.count("kvtier_peer_bytes_total", &["sent"], s.bytes_sent);
            self.count("kvtier_peer_requests_total", &["all"], s.requests);
            self.count(
                "kvtier_peer_requests_total",
                &["unauthorized"],
                s.unauthorized,
            );
            self.count("kvtier_peer_requests_total", &["rejected"], s.rejected);
        }
        for (k, x) in &n.g3_recovery {
            let x = *x;
            match *k {
                "index_rebuilt" => self.gauge("kvtier_g3_index_rebuilt_at_open", &[], x),
                "clean_start" => self.gauge("kvtier_g3_clean_start", &[], x),
                "orphans_reindexed" | "entries_dropped" | "temp_removed" | "strays_set_aside" => {
                    self.gauge("kvtier_g3_recovered_at_open", &[k], x)
                }
                "quarantined_at_open" => {
                    self.gauge("kvtier_g3_recovered_at_open", &["quarantined"], x)
                }
                "quarantine_bytes" => self.gauge("kvtier_g3_quarantine_bytes", &[], x),
                "disk_full" => self.gauge("kvtier_g3_disk_full", &[], x),
                "recycle_pool_bytes" | "recycle_pool_files" | "slots_used" | "slots_free"
                | "slabs" | "slot_pool_bytes" | "dir_bytes" => {
                    self.gauge(&format!("kvtier_g3_{k}"), &[], x)
                }
                "slots_torn_at_open" => {
                    self.gauge("kvtier_g3_recovered_at_open", &["slots_torn"], x)
                }
                // Also kvtier_quarantined_total (the backend's figure).
                "quarantined" => {}
                other => self.count(&format!("kvtier_g3_{other}_total"), &[], x),
            }
        }
        let pf = &n.prefetch;
        for (outcome, x) in [
            ("queued", pf.queued),
            ("already_local", pf.already_local),
            ("fetched", pf.fetched),
            ("missed", pf.missed),
            ("expired", pf.expired),
            ("superseded", pf.superseded),
            ("refused", pf.refused),
        ] {
            self.count("kvtier_prefetch_blocks_total", &[outcome], x);
        }
        self.gauge("kvtier_prefetch_waiting_blocks", &[], pf.waiting);
        for (src, p) in [("peer", n.promoted_from_peer), ("g4", n.promoted_from_g4)] {
            self.count("kvtier_promotions_total", &[src], p.count);
            self.count("kvtier_promotions_skipped_total", &[src], p.skipped);
            for (stage, us) in [("fetch", p.fetch_us), ("store", p.store_us)] {
                let c = self.promote_seconds.with_label_values(&[src, stage]);
                let target = us as f64 / 1e6;
                if target > c.get() {
                    c.inc_by(target - c.get());
                }
            }
        }
    }

    fn render_g4(&self, g: &crate::tiers::g4::G4StatsSnapshot, enqueued: u64) {
        self.gauge("kvtier_g4_upload_queue_depth", &[], g.upload_queue_depth);
        self.gauge("kvtier_g4_uploads_in_flight", &[], g.uploads_in_flight);
        self.gauge("kvtier_g4_breaker_open", &[], g.breaker_open);
        for (state, v) in [("failed", 0), ("passed", 1), ("not_run", 2)] {
            self.gauge(
                "kvtier_g4_startup_check",
                &[state],
                u64::from(g.startup_check_ok == v),
            );
        }
        self.upload_lag_seconds
            .with_label_values(&["last"])
            .set(g.upload_lag_ms_last as f64 / 1e3);
        self.upload_lag_seconds
            .with_label_values(&["max"])
            .set(g.upload_lag_ms_max as f64 / 1e3);
        self.count("kvtier_g4_uploads_enqueued_total", &[], enqueued);
        for (outcome, x) in [
            ("stored", g.uploads_stored),
            ("already_present", g.uploads_already_present),
            ("given_up", g.uploads_given_up),
            ("dropped_queue_full", g.uploads_dropped_queue_full),
            ("skipped_ephemeral", g.uploads_skipped_ephemeral),
            ("source_missing", g.uploads_source_missing),
            ("source_corrupt", g.uploads_source_corrupt),
        ] {
            self.count("kvtier_g4_uploads_total", &[outcome], x);
        }
        for (outcome, x) in [
            ("hit", g.fetch_hits),
            ("absent", g.fetch_absent),
            ("corrupt", g.fetch_corrupt),
            ("unavailable", g.fetch_unavailable),
        ] {
            self.count("kvtier_g4_fetches_total", &[outcome], x);
        }
        self.count(
            "kvtier_g4_exists_checks_total",
            &["cache"],
            g.exists_cache_hits,
        );
        self.count("kvtier_g4_exists_checks_total", &["head"], g.exists_heads);
        for (name, x) in [
            (
                "kvtier_g4_upload_attempt_failures_total",
                g.upload_attempt_failures,
            ),
            ("kvtier_g4_uploaded_bytes_total", g.uploads_stored_bytes),
            ("kvtier_g4_fetch_requests_total", g.fetch_requests),
            ("kvtier_g4_gets_total", g.fetch_gets),
            ("kvtier_g4_fetch_rereads_total", g.fetch_rereads),
            ("kvtier_g4_corrupt_deleted_total", g.fetch_corrupt_deleted),
            ("kvtier_g4_fetch_refused_size_total", g.fetch_refused_size),
            ("kvtier_g4_fetch_body_failures_total", g.fetch_body_failures),
            ("kvtier_g4_sweeps_total", g.sweep_runs),
            ("kvtier_g4_swept_blocks_total", g.sweep_deleted),
            ("kvtier_g4_swept_bytes_total", g.sweep_deleted_bytes),
            ("kvtier_g4_lifecycle_conflicts_total", g.lifecycle_conflicts),
            ("kvtier_g4_breaker_opened_total", g.breaker_opened),
            ("kvtier_g4_breaker_rejected_total", g.breaker_rejected),
            ("kvtier_g4_probes_total", g.probes),
            ("kvtier_g4_recoveries_total", g.recoveries),
            ("kvtier_g4_backlog_requeued_total", g.backlog_requeued),
            ("kvtier_g4_backlog_scans_total", g.backlog_scans),
            ("kvtier_g4_deleted_blocks_total", g.deleted_blocks),
            (
                "kvtier_g4_fetch_budget_refused_total",
                g.fetch_budget_refused,
            ),
        ] {
            self.count(name, &[], x);
        }
        self.gauge("kvtier_g4_listing_truncated", &[], g.listing_truncated);
        self.gauge("kvtier_g4_lifecycle_conflict", &[], g.lifecycle_conflict);
        self.gauge("kvtier_g4_backlog_blocks", &[], g.backlog_blocks);
        self.gauge("kvtier_g4_backlog_bytes", &[], g.backlog_bytes);
        self.gauge(
            "kvtier_g4_backlog_oldest_age_seconds",
            &[],
            crate::node::g4_backlog_age_seconds(g.backlog_oldest_unix_ms) as u64,
        );
        self.gauge(
            "kvtier_g4_fetch_buffered_bytes",
            &[],
            g.fetch_buffered_bytes,
        );
        self.gauge(
            "kvtier_g4_fetch_buffered_peak_bytes",
            &[],
            g.fetch_buffered_bytes_peak,
        );
    }
}

/// Connections the metrics endpoint serves at once.
pub const METRICS_CONNECTIONS_MAX: usize = 64;
/// Time a new metrics connection has to send its first byte.
const METRICS_FIRST_BYTE: std::time::Duration = std::time::Duration::from_secs(2);

static ACCEPT_WARN: crate::base::log_limit::LogLimit = crate::base::log_limit::LogLimit::new(1000);

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
    // Silent or idle connections are evicted for new ones (http_gate.rs):
    // a flood cannot starve /metrics or /healthz (the liveness probe).
    let gate = crate::base::http_gate::Gate::new(crate::base::http_gate::GateLimits {
        connections_max: METRICS_CONNECTIONS_MAX,
        pending_per_addr_max: METRICS_CONNECTIONS_MAX / 4,
    });
    loop {
        tokio::select! {
            _ = gate.room() => {}
            _ = shutdown.changed() => return,
        }
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = shutdown.changed() => return,
        };
        let (stream, from) = match accepted {
            Ok(s) => s,
            Err(e) => {
                // EMFILE and friends: back off instead of spinning on a
                // listener that stays readable, and say so once a second.
                crate::warn_limited!(ACCEPT_WARN, "metrics accept failed: {e}");
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                continue;
            }
        };
        // At most this many connections, so fds stay bounded; only when
        // each is in the middle of a request is a new one closed at once.
        let Some((ticket, mut evicted)) = gate.admit(from.ip()) else {
            drop(stream);
            continue;
        };
        let metrics = metrics.clone();
        let backend = backend.clone();
        tokio::spawn(async move {
            if !crate::base::http_gate::first_byte(&stream, METRICS_FIRST_BYTE, &mut evicted).await
            {
                return;
            }
            let ticket = Arc::new(ticket);
            let svc_ticket = ticket.clone();
            let svc =
                hyper::service::service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
                    let metrics = metrics.clone();
                    let backend = backend.clone();
                    let ticket = svc_ticket.clone();
                    async move {
                        // Not evicted while answering; evictable again
                        // once answered (keep-alive idle).
                        ticket.served();
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
                        ticket.idle();
                        Ok::<_, std::convert::Infallible>(resp)
                    }
                });
            let io = hyper_util::rt::TokioIo::new(stream);
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(std::time::Duration::from_secs(5))
                .serve_connection(io, svc);
            tokio::select! {
                _ = tokio::time::timeout(std::time::Duration::from_secs(30), conn) => {}
                _ = &mut evicted => {}
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testkit::mem_backend::{MemBackend, MemLimits};

    /// Hit and miss series exist at 0 before the first hit or miss, and
    /// the process collector's `process_*` families are exported.
    #[test]
    fn hit_miss_and_process_series_exist_from_start() {
        let m = Metrics::new().unwrap();
        let b = MemBackend::new(MemLimits::default(), std::env::temp_dir());
        let text = m.render(&b);
        for line in [
            "kvtier_hits_total{tier=\"g3\"} 0",
            "kvtier_hits_total{tier=\"peer\"} 0",
            "kvtier_hits_total{tier=\"g4\"} 0",
            "kvtier_misses_total{reason=\"absent\"} 0",
            "kvtier_misses_total{reason=\"corrupt\"} 0",
            "kvtier_misses_total{reason=\"unavailable\"} 0",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} missing in\n{text}");
        }
        #[cfg(target_os = "linux")]
        for name in [
            "process_cpu_seconds_total",
            "process_resident_memory_bytes",
            "process_open_fds",
            "process_max_fds",
            "process_start_time_seconds",
            "process_threads",
        ] {
            assert!(
                text.lines().any(|l| l.starts_with(name)),
                "{name} missing in\n{text}"
            );
        }
    }

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
        let cfg = crate::tiers::g3::G3Config::new(dir.path(), 1 << 26);
        let ns_dir = dir.path().join("blocks").join("00".repeat(16));
        std::fs::create_dir_all(&ns_dir).unwrap();
        std::fs::write(ns_dir.join("stray"), b"not a shard").unwrap();
        std::fs::write(dir.path().join("index.redb"), vec![0x5a; 8192]).unwrap();
        let g3 = crate::tiers::g3::G3Store::open(cfg, Box::new(crate::tiers::policy::Lru::new()))
            .unwrap();
        let m = Metrics::new().unwrap();
        let g = Arc::clone(&g3);
        m.set_figures(Arc::new(move || crate::node::NodeFigures {
            g3_recovery: g.recovery_figures(),
            ..Default::default()
        }));
        let b = MemBackend::new(MemLimits::default(), std::env::temp_dir());
        let text = m.render(&b);
        for line in [
            "kvtier_g3_index_rebuilt_at_open 1",
            "kvtier_g3_recovered_at_open{found=\"strays_set_aside\"} 1",
            "kvtier_g3_recovered_at_open{found=\"orphans_reindexed\"} 0",
            "kvtier_g3_renames_undone_total 0",
            "kvtier_g3_quarantine_bytes",
            "kvtier_g3_recycled_writes_total 0",
            "kvtier_g3_recycle_pool_bytes 0",
            "kvtier_g3_evicted_before_upload_total 0",
            "kvtier_g3_unreachable_removed_total 0",
        ] {
            assert!(text.contains(line), "{line} missing in\n{text}");
        }
    }

    /// Every scraped family gets a sample when every source is there: a
    /// name in the tables that render never sets would be a family that
    /// never shows up.
    #[test]
    fn every_scraped_family_is_filled() {
        let m = Metrics::new().unwrap();
        m.set_figures(Arc::new(|| crate::node::NodeFigures {
            g4: Some(Default::default()),
            peer: Some(Default::default()),
            peer_served: Some(Default::default()),
            g3_recovery: vec![
                ("index_rebuilt", 0),
                ("clean_start", 1),
                ("orphans_reindexed", 0),
                ("entries_dropped", 0),
                ("temp_removed", 0),
                ("strays_set_aside", 0),
                ("quarantined_at_open", 0),
                ("quarantined", 0),
                ("quarantine_bytes", 0),
                ("quarantine_trimmed", 0),
                ("renames_undone", 0),
                ("orphans_replaced", 0),
                ("evicted_before_upload", 0),
                ("unreachable_removed", 0),
                ("recycled_writes", 0),
                ("recycle_retired", 0),
                ("recycle_dropped", 0),
                ("recycle_pool_bytes", 0),
                ("recycle_pool_files", 0),
                ("disk_full", 0),
                ("empty_dirs_removed", 0),
                ("index_reopens", 0),
                ("slot_writes", 0),
                ("batch_reads", 0),
                ("slots_used", 0),
                ("slots_free", 0),
                ("slabs", 0),
                ("slot_pool_bytes", 0),
                ("dir_bytes", 0),
                ("slots_torn_at_open", 0),
            ],
            ..Default::default()
        }));
        m.set_mount(Arc::new(MountFigures::default));
        let bus = EventBus::new();
        bus.set_dynamo_worker(7);
        m.set_bus(bus);
        m.set_zmq_stats(Arc::new(crate::edges::zmq::ZmqStats::default()));
        let b = MemBackend::new(MemLimits::default(), std::env::temp_dir());
        let text = m.render(&b);
        for (name, _, _) in SCRAPED_COUNTERS.iter().chain(SCRAPED_GAUGES) {
            let sample = text.lines().any(|l| {
                !l.starts_with('#')
                    && l.starts_with(name)
                    && l[name.len()..].starts_with([' ', '{'])
            });
            assert!(sample, "{name} has no sample in\n{text}");
        }
    }
}
