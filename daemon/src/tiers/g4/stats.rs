//! Counters and gauges of the G4 tier; the daemon exports them to
//! Prometheus (`kvtier_g4_*`).

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

macro_rules! stats {
    ($( $(#[$doc:meta])* $name:ident ),* $(,)?) => {
        /// Live counters (atomics, updated by the tier).
        #[derive(Debug, Default)]
        pub struct G4Stats {
            $( $(#[$doc])* pub $name: AtomicU64, )*
        }
        /// A point-in-time copy of [`G4Stats`].
        #[derive(Debug, Default, Clone, PartialEq, Eq, serde::Serialize)]
        pub struct G4StatsSnapshot {
            $( $(#[$doc])* pub $name: u64, )*
        }
        impl G4Stats {
            /// Reads every counter.
            pub fn snapshot(&self) -> G4StatsSnapshot {
                G4StatsSnapshot { $( $name: self.$name.load(Relaxed), )* }
            }
        }
    };
}

stats! {
    /// Gauge: upload jobs waiting in the queue.
    upload_queue_depth,
    /// Gauge: uploads in flight.
    uploads_in_flight,
    /// Blocks newly written to G4 by the uploader.
    uploads_stored,
    /// Bytes (whole block files) of those blocks.
    uploads_stored_bytes,
    /// Uploads that found the object already there (another node won).
    uploads_already_present,
    /// Failed upload attempts (each retry counts).
    upload_attempt_failures,
    /// Uploads given up after all retries.
    uploads_given_up,
    /// Jobs dropped because the queue was full.
    uploads_dropped_queue_full,
    /// Jobs skipped because the block was hinted ephemeral.
    uploads_skipped_ephemeral,
    /// Jobs whose source no longer had the block (evicted before upload).
    uploads_source_missing,
    /// Jobs whose source bytes failed verification (never uploaded).
    uploads_source_corrupt,
    /// Gauge: enqueue-to-stored time of the last finished upload, ms.
    upload_lag_ms_last,
    /// Largest enqueue-to-stored time seen, ms.
    upload_lag_ms_max,
    /// Fetch calls (onboard fall-through).
    fetch_requests,
    /// GETs actually sent (single-flight makes this <= fetch_requests).
    fetch_gets,
    /// Fetches served verified bytes.
    fetch_hits,
    /// Fetches of absent objects.
    fetch_absent,
    /// Fetches that found a corrupt object (deleted from G4).
    fetch_corrupt,
    /// Fetches that failed or passed their deadline.
    fetch_unavailable,
    /// Existence answers served from the cache.
    exists_cache_hits,
    /// HEAD requests sent for existence.
    exists_heads,
    /// Sweeper runs.
    sweep_runs,
    /// Objects deleted by the sweeper.
    sweep_deleted,
    /// Bytes deleted by the sweeper.
    sweep_deleted_bytes,
    /// Sweeps that deleted nothing because another node's lifecycle view
    /// disagreed with this node's.
    lifecycle_conflicts,
    /// Gauge: 1 while the last sweep found the lifecycle not agreed.
    lifecycle_conflict,
    /// Gauge: bytes of blocks in G4 at the last sweep.
    sweep_last_total_bytes,
    /// Gauge: blocks in G4 at the last sweep.
    sweep_last_total_blocks,
    /// Gauge: 1 when the last listing (at start or a sweep) stopped at
    /// `sweep_list_max`, so G4's block count is a floor.
    listing_truncated,
    /// Gauge: 1 while the circuit breaker is open (G4 calls refused).
    breaker_open,
    /// Times the circuit breaker opened.
    breaker_opened,
    /// Calls refused by the open breaker (no request sent).
    breaker_rejected,
    /// Verification failures re-read before deciding (a good object is
    /// never deleted after one bad read).
    fetch_rereads,
    /// Corrupt objects deleted: the same ETag read corrupt twice.
    fetch_corrupt_deleted,
    /// Objects refused by size before buffering (above object_bytes_max,
    /// or not the size their header declares).
    fetch_refused_size,
    /// Bodies that ended early, stalled, or broke mid-stream (a miss, never
    /// a delete).
    fetch_body_failures,
    /// Gauge: 1 when the start-up check reached the store with working
    /// credentials, 0 when it did not (see /healthz), 2 before it ran.
    startup_check_ok,
    /// Objects this node deleted from G4 (evict, sweeper, proven
    /// corruption): subtracted from the census until the next listing.
    deleted_blocks,
    /// Bytes of those objects.
    deleted_bytes,
    /// Gauge: body bytes buffered by G4 fetches now (all fetches).
    fetch_buffered_bytes,
    /// Gauge: the most body bytes buffered at once since start.
    fetch_buffered_bytes_peak,
    /// Fetches that missed because the shared fetch byte budget
    /// (`fetch_buffer_bytes_max`) stayed taken past `response_timeout_ms`.
    fetch_budget_refused,
    /// Probes the active prober sent while the breaker was open or the
    /// start-up check was failing.
    probes,
    /// Times G4 recovered (breaker closed, or the start-up check passed
    /// after failing).
    recoveries,
    /// Gauge: G3 blocks not yet safe in G4 that admission would upload, at
    /// the last backlog scan (queued, in flight, or waiting for a re-queue).
    backlog_blocks,
    /// Gauge: bytes (block files) of those blocks.
    backlog_bytes,
    /// Gauge: creation time (unix ms) of the oldest of them; 0 when none.
    backlog_oldest_unix_ms,
    /// Blocks the backlog scanner re-queued for upload.
    backlog_requeued,
    /// Backlog scans run.
    backlog_scans,
}

pub(crate) fn inc(c: &AtomicU64) {
    c.fetch_add(1, Relaxed);
}

pub(crate) fn dec(c: &AtomicU64) {
    // Saturating: a gauge never wraps below zero.
    let _ = c.fetch_update(Relaxed, Relaxed, |v| Some(v.saturating_sub(1)));
}
