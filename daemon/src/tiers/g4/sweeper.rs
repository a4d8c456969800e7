//! G4 lifecycle: capacity and TTL, enforced by a sweeper that lists the
//! blocks, picks victims oldest first (by `last_modified`: G4 has no access
//! times) and deletes them in batches (`delete_stream`).
//!
//! Guarantee towards readers on other nodes: the sweeper never deletes an
//! object younger than `sweep_min_age_ms`, so a block that was just
//! uploaded (and may be about to be read) survives at least that long.
//! Deleting cannot make anyone serve wrong bytes: a GET after the delete is
//! a miss (the block is recomputed), and a GET already streaming completes
//! on S3, MinIO and SeaweedFS (and on file:// the open file keeps the inode).
//! Limits: a reader that learned of a block earlier than the grace period
//! and fetches it late may find it gone (a miss, never an error); capacity
//! can be exceeded while every object is younger than the grace period.

use super::{stats, Inner};
use crate::base::error::{Error, Result};
use futures::StreamExt;
use object_store::ObjectMeta;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Weak};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// What one sweep did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SweepReport {
    /// Objects listed.
    pub listed: u64,
    /// Bytes listed.
    pub listed_bytes: u64,
    /// Objects deleted.
    pub deleted: u64,
    /// Bytes deleted.
    pub deleted_bytes: u64,
    /// Whether listing stopped at `sweep_list_max`.
    pub truncated: bool,
    /// Objects the sweep would have deleted but did not: another node's
    /// lifecycle view disagreed (see `lifecycle.rs`).
    pub refused: u64,
}

const DELETE_BATCH: usize = 1000;

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

pub(crate) async fn sweep_once(inner: &Inner) -> Result<SweepReport> {
    let mut rep = SweepReport::default();
    let mark = super::census::uploader_mark(inner);
    let mut metas: Vec<ObjectMeta> = Vec::new();
    let mut list = inner.store.list(Some(&inner.blocks_root));
    while let Some(m) = list.next().await {
        let m = m.map_err(|e| inner.err("list", &inner.blocks_root, &e))?;
        if metas.len() >= inner.cfg.sweep_list_max {
            rep.truncated = true;
            break;
        }
        metas.push(m);
    }
    rep.listed = metas.len() as u64;
    rep.listed_bytes = metas.iter().map(|m| m.size).sum();
    metas.sort_by_key(|m| m.last_modified);
    let now = now_ms();
    let min_age = inner.cfg.sweep_min_age_ms as i64;
    let old_enough = |m: &ObjectMeta| now - m.last_modified.timestamp_millis() >= min_age;
    let mut total = rep.listed_bytes;
    let mut victims = Vec::new();
    for m in metas {
        if !old_enough(&m) {
            continue;
        }
        let expired = inner
            .cfg
            .ttl_ms
            .is_some_and(|ttl| now - m.last_modified.timestamp_millis() >= ttl as i64);
        let over = inner.cfg.capacity_bytes.is_some_and(|cap| total > cap);
        if expired || over {
            total = total.saturating_sub(m.size);
            victims.push(m);
        }
    }
    // A shared bucket is swept only by agreement: another node whose
    // lifecycle differs (or who set none) vetoes every deletion.
    if !victims.is_empty() {
        match super::lifecycle::check(inner).await? {
            super::lifecycle::Agreement::Agreed => {
                *super::lock(&inner.lifecycle_conflict) = None;
                inner.stats.lifecycle_conflict.store(0, Relaxed);
            }
            super::lifecycle::Agreement::Conflict(why) => {
                tracing::warn!(victims = victims.len(), "G4 sweep deletes nothing: {why}");
                stats::inc(&inner.stats.lifecycle_conflicts);
                inner.stats.lifecycle_conflict.store(1, Relaxed);
                *super::lock(&inner.lifecycle_conflict) = Some(why);
                rep.refused = victims.len() as u64;
                victims.clear();
            }
        }
    }
    for chunk in victims.chunks(DELETE_BATCH) {
        let paths: Vec<_> = chunk.iter().map(|m| Ok(m.location.clone())).collect();
        let mut done = inner
            .store
            .delete_stream(futures::stream::iter(paths).boxed());
        let sizes: std::collections::HashMap<&str, u64> = chunk
            .iter()
            .map(|m| (m.location.as_ref(), m.size))
            .collect();
        let mut deleted = Vec::with_capacity(chunk.len());
        while let Some(r) = done.next().await {
            match r {
                Ok(p) => {
                    rep.deleted += 1;
                    rep.deleted_bytes += sizes.get(p.as_ref()).copied().unwrap_or(0);
                    inner.set_exists(&p, false);
                    deleted.push(p);
                }
                Err(object_store::Error::NotFound { .. }) => {}
                Err(e) => {
                    inner.notify_deleted(&deleted);
                    inner.count_deleted(rep.deleted, rep.deleted_bytes);
                    return Err(Error::ObjectStore {
                        op: "delete",
                        location: inner.blocks_root.to_string(),
                        detail: inner.scrub(&e.to_string()),
                    });
                }
            }
        }
        inner.notify_deleted(&deleted);
    }
    stats::inc(&inner.stats.sweep_runs);
    inner.stats.sweep_deleted.fetch_add(rep.deleted, Relaxed);
    // Counted as this node's deletions after `mark`: the census subtracts
    // them from the listing below.
    inner.count_deleted(rep.deleted, rep.deleted_bytes);
    inner
        .stats
        .sweep_deleted_bytes
        .fetch_add(rep.deleted_bytes, Relaxed);
    inner.stats.sweep_last_total_bytes.store(
        rep.listed_bytes - rep.deleted_bytes.min(rep.listed_bytes),
        Relaxed,
    );
    inner
        .stats
        .sweep_last_total_blocks
        .store(rep.listed - rep.deleted.min(rep.listed), Relaxed);
    inner
        .census
        .record(mark, rep.listed, rep.listed_bytes, rep.truncated);
    inner
        .stats
        .listing_truncated
        .store(u64::from(rep.truncated), Relaxed);
    Ok(rep)
}

/// Runs [`sweep_once`] every `sweep_interval_ms` until the store is dropped.
pub(crate) fn spawn_background(inner: &Arc<Inner>) {
    let weak: Weak<Inner> = Arc::downgrade(inner);
    let every = Duration::from_millis(inner.cfg.sweep_interval_ms.max(100));
    inner.handle.spawn(async move {
        loop {
            tokio::time::sleep(every).await;
            let Some(inner) = weak.upgrade() else { return };
            if let Err(e) = sweep_once(&inner).await {
                tracing::warn!(error = %e, "G4 sweep failed");
            }
        }
    });
}
