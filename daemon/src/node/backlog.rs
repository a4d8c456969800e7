//! The G4 backlog: G3 blocks not yet safe in G4 that admission would
//! upload (no `in_g4` mark). Jobs for them are lost to an outage longer
//! than the uploader's retries, a full queue, or a restart; the G3 index
//! still knows them, so one thread scans it and queues them again:
//!
//! - at start;
//! - at once when G4 recovers (the breaker closes, or a failed start-up
//!   check passes: `G4Store::set_on_recovered`), and when it goes down
//!   (the breaker opens: `G4Store::set_on_outage`);
//! - while the last scan found a backlog, after `g4.backlog_retry_ms`,
//!   doubling up to `g4.backlog_scan_interval_ms`, each delay +-20%
//!   jittered (nodes that lost G4 together do not rescan together);
//! - every `g4.backlog_scan_interval_ms` when uploads were given up or
//!   dropped since the last scan. A healthy idle node does not scan.
//!
//! A scan queues nothing while the breaker is open (the upload would only
//! fail again); it still counts, so `kvtier_g4_backlog_*` stay true.
//! Blocks already queued or in flight are not queued twice. Memory: one
//! page of 1024 keys at a time; the queue's bound applies (a full queue
//! stops the queueing, the next scan goes on).

use super::Node;
use crate::tiers::g4::{BreakerState, EnqueueOutcome, G4Store};
use crate::tiers::policy::admission::AdmissionEvent;
use kvtier_client::{BlockKey, Hints};
use std::sync::mpsc::{sync_channel, RecvTimeoutError, SyncSender};
use std::sync::{Arc, Weak};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// What one scan found.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(super) struct Scan {
    pub(super) blocks: u64,
    pub(super) bytes: u64,
    /// Creation time (unix ms) of the oldest; 0 when none.
    pub(super) oldest_unix_ms: u64,
    /// Jobs this scan queued.
    pub(super) queued: u64,
}

/// Uploads lost since start (given up, dropped on a full queue): a rise
/// means a backlog that no job covers.
fn lost(g4: &G4Store) -> u64 {
    let s = g4.stats();
    s.uploads_given_up + s.uploads_dropped_queue_full
}

/// Counts the backlog and, when `requeue`, queues its blocks.
pub(super) fn scan(node: &Node, g4: &G4Store, requeue: bool) -> Scan {
    let mut out = Scan::default();
    let mut queue_full = false;
    for ns in node.g3.namespaces() {
        let mut after: Option<BlockKey> = None;
        loop {
            let page = node.g3.list(&ns, after.as_ref(), 1024);
            let Some(last) = page.last().copied() else {
                break;
            };
            for key in page {
                let Some(info) = node.g3.stat(&ns, &key) else {
                    continue;
                };
                if info.in_g4 {
                    continue;
                }
                let hints = Hints {
                    priority: info.priority,
                    pinned: info.pinned,
                    ephemeral: info.ephemeral,
                    expected_reuse: 0,
                };
                // Would admission upload it at all: at store time (`all`),
                // or once reused (`after-first-reuse`). A block that was
                // read since (hits > 0) still counts under `all`.
                let a = node.admission;
                let admitted = a.should_write(AdmissionEvent::Stored, hints, false)
                    || (info.hits > 0 && a.should_write(AdmissionEvent::Hit, hints, false));
                if !admitted {
                    continue;
                }
                out.blocks += 1;
                out.bytes += info.file_len;
                if out.oldest_unix_ms == 0 || info.created_unix_ms < out.oldest_unix_ms {
                    out.oldest_unix_ms = info.created_unix_ms.max(1);
                }
                if requeue && !queue_full {
                    match g4.enqueue(&ns, &key, hints) {
                        EnqueueOutcome::Queued => {
                            node.g4_enqueued
                                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            out.queued += 1;
                        }
                        EnqueueOutcome::DroppedQueueFull => queue_full = true,
                        _ => {}
                    }
                }
            }
            after = Some(last);
        }
    }
    tracing::debug!(?out, requeue, "g4: backlog scan");
    g4.set_backlog(out.blocks, out.bytes, out.oldest_unix_ms);
    g4.count_requeued(out.queued);
    out
}

/// The scan thread's schedule (pure: tested without threads).
#[derive(Debug, Clone)]
pub(super) struct Schedule {
    retry_min: Duration,
    interval: Duration,
    /// The next delay while a backlog remains.
    retry: Duration,
}

impl Schedule {
    pub(super) fn new(retry_min: Duration, interval: Duration) -> Self {
        let retry_min = retry_min.min(interval);
        Schedule {
            retry_min,
            interval,
            retry: retry_min,
        }
    }

    /// The wait after a scan that found `backlog` blocks (before jitter).
    pub(super) fn after_scan(&mut self, backlog: u64) -> Duration {
        if backlog == 0 {
            self.retry = self.retry_min;
            return self.interval;
        }
        let d = self.retry;
        self.retry = (self.retry * 2).min(self.interval);
        d
    }

    /// G4 recovered: scan now and retry quickly again.
    pub(super) fn recovered(&mut self) {
        self.retry = self.retry_min;
    }
}

/// Starts the backlog thread; its first scan runs at once.
pub(super) fn spawn(node: &Arc<Node>) {
    let Some(g4) = node.g4.clone() else { return };
    // Wake-ups from G4's recovery hook; one pending is enough.
    let (tx, rx) = sync_channel::<()>(1);
    let hook_tx: SyncSender<()> = tx;
    let outage_tx = hook_tx.clone();
    g4.set_on_recovered(Arc::new(move || {
        let _ = hook_tx.try_send(());
    }));
    // An outage starts a backlog no scan has counted yet: counted at once,
    // then as a backlog is (`g4.backlog_retry_ms`, doubling), so the
    // gauges follow the outage instead of reading 0 until the next scan.
    g4.set_on_outage(Arc::new(move || {
        let _ = outage_tx.try_send(());
    }));
    let cfg = g4.config().clone();
    let weak: Weak<Node> = Arc::downgrade(node);
    drop(g4);
    let spawned = std::thread::Builder::new()
        .name("kvtier-g4-backlog".into())
        .spawn(move || {
            let mut sched = Schedule::new(
                Duration::from_millis(cfg.backlog_retry_ms),
                Duration::from_millis(cfg.backlog_scan_interval_ms),
            );
            // Scans always run when a backlog remains; otherwise only when
            // uploads were lost since the last one.
            let mut lost_at_scan: Option<u64> = None;
            let mut backlog = 0u64;
            let mut wait = Duration::ZERO;
            let mut woken = true;
            loop {
                if !wait.is_zero() {
                    match rx.recv_timeout(crate::tiers::g4::jittered(wait)) {
                        Ok(()) => woken = true,
                        Err(RecvTimeoutError::Timeout) => {}
                        Err(RecvTimeoutError::Disconnected) => return,
                    }
                }
                let Some(node) = weak.upgrade() else { return };
                let Some(g4) = node.g4.clone() else { return };
                let lost_now = lost(&g4);
                if woken || backlog > 0 || lost_at_scan != Some(lost_now) {
                    if woken {
                        sched.recovered();
                    }
                    let healthy = g4.breaker_state() == BreakerState::Closed;
                    let s = scan(&node, &g4, healthy);
                    if s.queued > 0 {
                        tracing::info!(
                            queued = s.queued,
                            backlog = s.blocks,
                            "g4: re-queued blocks not yet uploaded"
                        );
                    }
                    backlog = s.blocks;
                    lost_at_scan = Some(lost_now);
                    wait = sched.after_scan(backlog);
                } else {
                    wait = sched.after_scan(0);
                }
                woken = false;
            }
        });
    if let Err(e) = spawned {
        tracing::warn!(error = %e, "g4: cannot start the backlog thread");
    }
}

/// Seconds since `unix_ms` (0 for 0: no backlog).
pub fn age_seconds(unix_ms: u64) -> f64 {
    if unix_ms == 0 {
        return 0.0;
    }
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    now.saturating_sub(unix_ms) as f64 / 1e3
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backs_off_while_a_backlog_remains_and_resets() {
        let mut s = Schedule::new(Duration::from_secs(2), Duration::from_secs(60));
        let waits: Vec<u64> = (0..7).map(|_| s.after_scan(5).as_secs()).collect();
        assert_eq!(waits, [2, 4, 8, 16, 32, 60, 60]);
        s.recovered();
        assert_eq!(s.after_scan(5).as_secs(), 2);
        assert_eq!(s.after_scan(0).as_secs(), 60);
        assert_eq!(s.after_scan(1).as_secs(), 2);
    }
}
