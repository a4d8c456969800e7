//! How many blocks G4 holds, as far as this node can tell.
//!
//! Object stores keep no cheap count, so the figure comes from listings:
//! one at start (in the background, bounded by `sweep_list_max`) and the
//! sweeper's every pass, plus the blocks this node's uploader stored since
//! the last listing, minus the objects this node deleted since (`kvtier
//! evict --tier g4`, the sweeper's own deletions, proven corruption). Until the first listing has finished the count is
//! "not yet known" (`None`), never 0: a node that just started next to a
//! bucket of 131 blocks must not report an empty G4.
//!
//! Limits: uploads by other nodes and deletions by other sweepers show up
//! only at the next listing; a listing that stopped at `sweep_list_max` is
//! a lower bound (`truncated`).

use super::Inner;
use futures::StreamExt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Weak};

/// The last listing's figures and the uploader's count at that moment.
#[derive(Debug, Default)]
pub(crate) struct Census {
    known: AtomicBool,
    truncated: AtomicBool,
    listed_blocks: AtomicU64,
    listed_bytes: AtomicU64,
    /// `uploads_stored` / `uploads_stored_bytes` when the listing began.
    stored_at_listing: AtomicU64,
    stored_bytes_at_listing: AtomicU64,
    /// `deleted_blocks` / `deleted_bytes` when the listing began.
    deleted_at_listing: AtomicU64,
    deleted_bytes_at_listing: AtomicU64,
}

/// G4's occupancy as [`Census`] knows it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct G4Count {
    /// Blocks in G4: the last listing plus this node's uploads since,
    /// minus its deletions since.
    pub blocks: u64,
    /// Bytes of those blocks (object sizes).
    pub bytes: u64,
    /// The listing stopped at `sweep_list_max` (the figures are a floor).
    pub truncated: bool,
}

/// This node's running totals of uploads and deletions, read before a
/// listing starts.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Mark {
    stored: u64,
    stored_bytes: u64,
    deleted: u64,
    deleted_bytes: u64,
}

pub(crate) fn uploader_mark(inner: &Inner) -> Mark {
    let st = &inner.stats;
    Mark {
        stored: st.uploads_stored.load(Relaxed),
        stored_bytes: st.uploads_stored_bytes.load(Relaxed),
        deleted: st.deleted_blocks.load(Relaxed),
        deleted_bytes: st.deleted_bytes.load(Relaxed),
    }
}

impl Census {
    /// Records a finished listing; `mark` is [`uploader_mark`] taken before
    /// it began (uploads during the listing may then count twice until the
    /// next one: an overestimate by at most the uploads of one listing).
    pub(crate) fn record(&self, mark: Mark, blocks: u64, bytes: u64, truncated: bool) {
        self.listed_blocks.store(blocks, Relaxed);
        self.listed_bytes.store(bytes, Relaxed);
        self.stored_at_listing.store(mark.stored, Relaxed);
        self.stored_bytes_at_listing
            .store(mark.stored_bytes, Relaxed);
        self.deleted_at_listing.store(mark.deleted, Relaxed);
        self.deleted_bytes_at_listing
            .store(mark.deleted_bytes, Relaxed);
        self.truncated.store(truncated, Relaxed);
        self.known.store(true, Relaxed);
    }

    /// The count now, `None` before the first listing finished.
    pub(crate) fn count(&self, inner: &Inner) -> Option<G4Count> {
        if !self.known.load(Relaxed) {
            return None;
        }
        let now = uploader_mark(inner);
        let since = |v: u64, at: &AtomicU64| v.saturating_sub(at.load(Relaxed));
        Some(G4Count {
            blocks: (self.listed_blocks.load(Relaxed) + since(now.stored, &self.stored_at_listing))
                .saturating_sub(since(now.deleted, &self.deleted_at_listing)),
            bytes: (self.listed_bytes.load(Relaxed)
                + since(now.stored_bytes, &self.stored_bytes_at_listing))
            .saturating_sub(since(now.deleted_bytes, &self.deleted_bytes_at_listing)),
            truncated: self.truncated.load(Relaxed),
        })
    }
}

/// Lists `blocks/` once (at most `sweep_list_max` objects) and records it.
pub(crate) async fn list_once(inner: &Inner) -> crate::base::error::Result<()> {
    let mark = uploader_mark(inner);
    let (mut blocks, mut bytes, mut truncated) = (0u64, 0u64, false);
    let mut list = inner.store.list(Some(&inner.blocks_root));
    while let Some(m) = list.next().await {
        let m = m.map_err(|e| inner.err("list", &inner.blocks_root, &e))?;
        if blocks as usize >= inner.cfg.sweep_list_max {
            truncated = true;
            break;
        }
        blocks += 1;
        bytes += m.size;
    }
    inner.census.record(mark, blocks, bytes, truncated);
    inner
        .stats
        .listing_truncated
        .store(u64::from(truncated), Relaxed);
    Ok(())
}

/// Starts the listing at start in the background. A failure (store down)
/// is retried with backoff until it succeeds or the store is dropped; the
/// count stays "not yet known" meanwhile.
pub(crate) fn spawn_at_start(inner: &Arc<Inner>) {
    let weak: Weak<Inner> = Arc::downgrade(inner);
    inner.handle.spawn(async move {
        let mut backoff = std::time::Duration::from_millis(500);
        loop {
            let Some(inner) = weak.upgrade() else { return };
            if inner.census.known.load(Relaxed) {
                return; // a sweep got there first
            }
            match list_once(&inner).await {
                Ok(()) => return,
                Err(e) => tracing::debug!(error = %e, "G4 listing at start failed; retrying"),
            }
            drop(inner);
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(std::time::Duration::from_secs(60));
        }
    });
}
