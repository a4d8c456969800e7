//! Counters and state for metrics ([`G3Stats`]).

use super::G3Store;
use std::sync::atomic::{AtomicU64, Ordering};

/// Counters and state, for metrics.
#[derive(Debug, Clone, PartialEq)]
pub struct G3Stats {
    /// Blocks indexed.
    pub blocks: u64,
    /// Bytes of block files.
    pub used_bytes: u64,
    /// Configured capacity.
    pub capacity_bytes: u64,
    /// Verified reads served.
    pub hits: u64,
    /// Reads that missed (absent or corrupt).
    pub misses: u64,
    /// Blocks evicted.
    pub evictions: u64,
    /// Blocks moved to quarantine.
    pub quarantined: u64,
    /// Bytes in `quarantine/` now (bounded by `quarantine_max_bytes`,
    /// counted against capacity).
    pub quarantine_bytes: u64,
    /// Quarantined entries deleted to keep within the bounds.
    pub quarantine_trimmed: u64,
    /// Writes that failed.
    pub write_errors: u64,
    /// Renames undone after a failed group commit.
    pub renames_undone: u64,
    /// Unindexed (orphan) block files replaced by a fresh offload.
    pub orphans_replaced: u64,
    /// `io_uring` or `pread`.
    pub engine: &'static str,
    /// Whether block files use O_DIRECT.
    pub direct_io: bool,
    /// Why writes are refused, if they are.
    pub read_only: Option<String>,
}

/// The store's live counters (`seq` also numbers temp files and leases).
#[derive(Default)]
pub(super) struct Counters {
    pub(super) hits: AtomicU64,
    pub(super) misses: AtomicU64,
    pub(super) evictions: AtomicU64,
    pub(super) quarantined: AtomicU64,
    /// Bytes in `quarantine/` now (counted against capacity).
    pub(super) quarantine_bytes: AtomicU64,
    pub(super) quarantine_trimmed: AtomicU64,
    pub(super) write_errors: AtomicU64,
    pub(super) renames_undone: AtomicU64,
    pub(super) orphans_replaced: AtomicU64,
    /// Evicted while G4 write-through was on and before their upload.
    pub(super) evicted_before_upload: AtomicU64,
    /// Blocks removed because a forced removal took their parent.
    pub(super) unreachable_removed: AtomicU64,
    /// Offloads that overwrote a recycled file (recycle.rs).
    pub(super) recycled_writes: AtomicU64,
    /// Evicted files retired into the recycle pool.
    pub(super) recycle_retired: AtomicU64,
    /// Pooled files unlinked.
    pub(super) recycle_dropped: AtomicU64,
    /// Empty shard and namespace directories removed (remove.rs).
    pub(super) dirs_removed: AtomicU64,
    /// What the directories under `blocks/` are charged against
    /// capacity (dir_set.rs).
    pub(super) dir_bytes: AtomicU64,
    /// Offloads written into a slab slot (slots.rs).
    pub(super) slot_writes: AtomicU64,
    /// Onboard hits read in a request's batch (read_batch.rs).
    pub(super) batch_reads: AtomicU64,
    pub(super) seq: AtomicU64,
}

impl G3Store {
    /// What recovery at open found and what the store repaired since
    /// (Prometheus `kvtier_g3_*`, see metrics.rs): (stat, value) pairs.
    pub fn recovery_figures(&self) -> Vec<(&'static str, u64)> {
        let st = self.stats();
        let r = self.recovery.lock().map(|r| r.clone()).unwrap_or_default();
        let rc = self.recycle_counts();
        let c = &self.counters;
        let (slots_used, slots_free, slabs) = self.slots.counts();
        vec![
            ("index_rebuilt", u64::from(r.index_rebuilt)),
            ("clean_start", u64::from(r.clean_start)),
            ("orphans_reindexed", r.adopted),
            ("entries_dropped", r.dropped),
            ("temp_removed", r.temp_removed),
            ("strays_set_aside", r.set_aside),
            ("quarantined_at_open", r.quarantined),
            ("quarantined", st.quarantined),
            ("quarantine_bytes", st.quarantine_bytes),
            ("quarantine_trimmed", st.quarantine_trimmed),
            ("renames_undone", st.renames_undone),
            ("orphans_replaced", st.orphans_replaced),
            (
                "evicted_before_upload",
                c.evicted_before_upload.load(Ordering::Relaxed),
            ),
            (
                "unreachable_removed",
                c.unreachable_removed.load(Ordering::Relaxed),
            ),
            ("recycled_writes", rc.recycled_writes),
            ("recycle_retired", rc.retired),
            ("recycle_dropped", rc.dropped),
            ("recycle_pool_bytes", rc.bytes),
            ("recycle_pool_files", rc.files),
            ("disk_full", u64::from(self.disk_full())),
            ("empty_dirs_removed", c.dirs_removed.load(Ordering::Relaxed)),
            ("index_reopens", self.disk.reopens.load(Ordering::Relaxed)),
            ("slot_writes", c.slot_writes.load(Ordering::Relaxed)),
            ("batch_reads", c.batch_reads.load(Ordering::Relaxed)),
            ("slots_used", slots_used),
            ("slots_free", slots_free),
            ("slabs", slabs),
            ("slot_pool_bytes", self.slot_pooled_bytes()),
            ("slots_torn_at_open", r.slots_torn),
            ("dir_bytes", c.dir_bytes.load(Ordering::Relaxed)),
        ]
    }

    /// Counters and occupancy.
    pub fn stats(&self) -> G3Stats {
        let (blocks, used_bytes) = self
            .mem
            .read()
            .map(|m| (m.map.len() as u64, m.used_bytes))
            .unwrap_or((0, 0));
        let c = &self.counters;
        G3Stats {
            blocks,
            used_bytes,
            capacity_bytes: self.cfg.capacity_bytes,
            hits: c.hits.load(Ordering::Relaxed),
            misses: c.misses.load(Ordering::Relaxed),
            evictions: c.evictions.load(Ordering::Relaxed),
            quarantined: c.quarantined.load(Ordering::Relaxed),
            quarantine_bytes: c.quarantine_bytes.load(Ordering::Relaxed),
            quarantine_trimmed: c.quarantine_trimmed.load(Ordering::Relaxed),
            write_errors: c.write_errors.load(Ordering::Relaxed),
            renames_undone: c.renames_undone.load(Ordering::Relaxed),
            orphans_replaced: c.orphans_replaced.load(Ordering::Relaxed),
            engine: self.engine.name(),
            direct_io: self.direct_ok,
            read_only: self.poisoned.lock().ok().and_then(|p| p.clone()),
        }
    }
}
