//! Asynchronous write-through: after a block is durable on G3 it is queued
//! here and uploaded in the background.
//!
//! Limits: the queue holds at most `upload_queue_max` jobs (a full queue
//! drops the job and counts it: memory never grows), at most
//! `upload_concurrency` uploads run, each retried `upload_retries` times
//! with doubling backoff. A job carries no bytes: the block is read from its
//! [`BlockSource`] (G3) at upload time and verified before it leaves the
//! node, so a block evicted meanwhile is skipped, not resurrected.
//!
//! Losing a job (queue full, retries exhausted, daemon stopped) loses no
//! block: G3 keeps it unmarked until `on_uploaded` reports it safe in G4,
//! and the node re-queues unmarked blocks (at start, when G4 recovers, and
//! periodically while a backlog remains: node/backlog.rs). A block already
//! queued or in flight is not queued twice (`AlreadyQueued`).
//!
//! Logging: failed attempts and given-up jobs are counted in metrics and
//! warned about at most once per 10 s (with the number suppressed), so an
//! outage costs a few lines, not one per attempt per block.

use super::{lock, stats, Inner};
use crate::base::error::{Error, Result};
use crate::base::log_limit::LogLimit;
use kvtier_client::{BlockKey, Hints, NamespaceId};
use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, Notify, Semaphore};

/// Where the uploader reads a block file (header + payload) at upload time.
pub trait BlockSource: Send + Sync + 'static {
    /// The whole block file, or `None` when the block is gone.
    fn read_block(&self, ns: &NamespaceId, key: &BlockKey) -> Option<Vec<u8>>;
}

impl<F> BlockSource for F
where
    F: Fn(&NamespaceId, &BlockKey) -> Option<Vec<u8>> + Send + Sync + 'static,
{
    fn read_block(&self, ns: &NamespaceId, key: &BlockKey) -> Option<Vec<u8>> {
        self(ns, key)
    }
}

/// How an upload job ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum UploadOutcome {
    /// Written to G4 now.
    Stored,
    /// Another writer had stored it already: it is safe in G4.
    AlreadyPresent,
    /// The source no longer had the block.
    SourceMissing,
    /// The source's bytes failed verification; nothing was uploaded.
    SourceCorrupt,
    /// Every attempt failed; the block is not in G4.
    GaveUp,
}

impl UploadOutcome {
    /// Whether the block is now safely in G4 (G3 may evict it cheaply).
    pub fn is_safe_in_g4(self) -> bool {
        matches!(self, UploadOutcome::Stored | UploadOutcome::AlreadyPresent)
    }
}

/// Called once per finished job, from a G4 runtime thread (keep it short).
pub type OnUploaded = Arc<dyn Fn(&NamespaceId, &BlockKey, UploadOutcome) + Send + Sync>;

/// What [`super::G4Store::enqueue`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum EnqueueOutcome {
    /// Queued.
    Queued,
    /// Hinted ephemeral: never uploaded.
    SkippedEphemeral,
    /// The queue was full: dropped and counted.
    DroppedQueueFull,
    /// Already queued or being uploaded: not queued twice.
    AlreadyQueued,
}

struct Job {
    ns: NamespaceId,
    key: BlockKey,
    enqueued: Instant,
}

pub(crate) struct Queue {
    tx: mpsc::Sender<Job>,
    rx: Mutex<Option<mpsc::Receiver<Job>>>,
    /// Jobs queued or in flight.
    pending: AtomicU64,
    idle: Notify,
    /// The blocks of those jobs (at most queue + concurrency entries).
    keys: Mutex<HashSet<(NamespaceId, BlockKey)>>,
}

impl Queue {
    pub(crate) fn new(max: usize) -> Self {
        let (tx, rx) = mpsc::channel(max.max(1));
        Queue {
            tx,
            rx: Mutex::new(Some(rx)),
            pending: AtomicU64::new(0),
            idle: Notify::new(),
            keys: Mutex::new(HashSet::new()),
        }
    }

    fn done_one(&self, ns: &NamespaceId, key: &BlockKey) {
        lock(&self.keys).remove(&(*ns, *key));
        if self.pending.fetch_sub(1, Relaxed) == 1 {
            self.idle.notify_waiters();
        }
    }
}

pub(crate) fn enqueue(
    inner: &Inner,
    ns: &NamespaceId,
    key: &BlockKey,
    hints: Hints,
) -> EnqueueOutcome {
    if hints.ephemeral {
        stats::inc(&inner.stats.uploads_skipped_ephemeral);
        return EnqueueOutcome::SkippedEphemeral;
    }
    let q = &inner.uploads;
    if !lock(&q.keys).insert((*ns, *key)) {
        return EnqueueOutcome::AlreadyQueued;
    }
    q.pending.fetch_add(1, Relaxed);
    let job = Job {
        ns: *ns,
        key: *key,
        enqueued: Instant::now(),
    };
    // Counted before the send: the dispatcher may take the job (and
    // decrement, saturating at 0) before this thread runs again, which
    // left the gauge at 1 with the queue empty (g4_behaviour
    // write_through_uploads_and_reports_safe, once in a CI run).
    stats::inc(&inner.stats.upload_queue_depth);
    match q.tx.try_send(job) {
        Ok(()) => EnqueueOutcome::Queued,
        Err(_) => {
            stats::dec(&inner.stats.upload_queue_depth);
            q.done_one(ns, key);
            stats::inc(&inner.stats.uploads_dropped_queue_full);
            EnqueueOutcome::DroppedQueueFull
        }
    }
}

pub(crate) fn start(
    inner: &Arc<Inner>,
    source: Arc<dyn BlockSource>,
    on_uploaded: Option<OnUploaded>,
) -> Result<()> {
    let rx = inner
        .uploads
        .rx
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .take()
        .ok_or(Error::InvalidInput {
            what: "G4 uploader",
            reason: "already started".into(),
        })?;
    let inner2 = inner.clone();
    inner
        .handle
        .spawn(dispatch(inner2, rx, source, on_uploaded));
    Ok(())
}

async fn dispatch(
    inner: Arc<Inner>,
    mut rx: mpsc::Receiver<Job>,
    source: Arc<dyn BlockSource>,
    on_uploaded: Option<OnUploaded>,
) {
    let permits = Arc::new(Semaphore::new(inner.cfg.upload_concurrency));
    while let Some(job) = rx.recv().await {
        let Ok(permit) = permits.clone().acquire_owned().await else {
            break;
        };
        stats::dec(&inner.stats.upload_queue_depth);
        stats::inc(&inner.stats.uploads_in_flight);
        let (inner2, source2, cb) = (inner.clone(), source.clone(), on_uploaded.clone());
        tokio::spawn(async move {
            let out = upload_one(&inner2, &source2, &job).await;
            if let Some(cb) = cb {
                cb(&job.ns, &job.key, out);
            }
            drop(permit);
            stats::dec(&inner2.stats.uploads_in_flight);
            inner2.uploads.done_one(&job.ns, &job.key);
        });
    }
}

static ATTEMPT_LOG: LogLimit = LogLimit::new(10_000);

async fn upload_one(inner: &Inner, source: &Arc<dyn BlockSource>, job: &Job) -> UploadOutcome {
    let (src, ns, key) = (source.clone(), job.ns, job.key);
    let file = match tokio::task::spawn_blocking(move || src.read_block(&ns, &key)).await {
        Ok(Some(f)) => f,
        Ok(None) | Err(_) => {
            stats::inc(&inner.stats.uploads_source_missing);
            return UploadOutcome::SourceMissing;
        }
    };
    // Bytes cross disk -> memory -> network here: verify before they leave.
    match kvtier_client::decode_block(&file) {
        Ok((h, _)) if h.namespace_id() == job.ns && h.key == job.key => {}
        _ => {
            stats::inc(&inner.stats.uploads_source_corrupt);
            return UploadOutcome::SourceCorrupt;
        }
    }
    let loc = inner.path(&job.ns, &job.key);
    let file = bytes::Bytes::from(file);
    let mut backoff = Duration::from_millis(inner.cfg.retry_backoff_ms.max(1));
    let backoff_max = Duration::from_millis(inner.cfg.retry_backoff_max_ms.max(1));
    for attempt in 0..=inner.cfg.upload_retries {
        match inner.put_file(&loc, file.clone()).await {
            Ok(out) => {
                let lag = job.enqueued.elapsed().as_millis() as u64;
                inner.stats.upload_lag_ms_last.store(lag, Relaxed);
                inner.stats.upload_lag_ms_max.fetch_max(lag, Relaxed);
                return match out {
                    crate::base::tier::PutOutcome::Stored
                    | crate::base::tier::PutOutcome::StoredUnpinned => {
                        stats::inc(&inner.stats.uploads_stored);
                        inner
                            .stats
                            .uploads_stored_bytes
                            .fetch_add(file.len() as u64, Relaxed);
                        UploadOutcome::Stored
                    }
                    crate::base::tier::PutOutcome::AlreadyPresent => {
                        stats::inc(&inner.stats.uploads_already_present);
                        UploadOutcome::AlreadyPresent
                    }
                };
            }
            Err(e) => {
                stats::inc(&inner.stats.upload_attempt_failures);
                crate::warn_limited!(ATTEMPT_LOG, location = %loc, attempt, error = %e,
                    "G4 upload failed (kvtier_g4_upload_attempt_failures_total counts them all)");
                if attempt < inner.cfg.upload_retries {
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(backoff_max);
                }
            }
        }
    }
    stats::inc(&inner.stats.uploads_given_up);
    UploadOutcome::GaveUp
}

pub(crate) async fn flush(inner: &Inner, timeout: Duration) -> bool {
    let q = &inner.uploads;
    let wait = async {
        loop {
            let idle = q.idle.notified();
            if q.pending.load(Relaxed) == 0 {
                return;
            }
            // Re-check periodically: a notify between the load and the
            // await would otherwise be missed.
            let _ = tokio::time::timeout(Duration::from_millis(50), idle).await;
        }
    };
    tokio::time::timeout(timeout, wait).await.is_ok()
}
