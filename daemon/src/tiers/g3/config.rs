//! What an operator sets: [`G3Config`] (capacity, watermarks, engine, I/O
//! depth, buffer pool, lease and pin limits) and [`SyncMode`], with the
//! checks `open` runs on them.

use super::engine::{EngineKind, CHUNK_BYTES};
use crate::base::error::{Error, Result};
use std::path::PathBuf;

/// Most block operations in flight at once (rings in the io_uring pool).
pub const IO_DEPTH_MAX: usize = 256;

/// The default of [`G3Config::slot_file_bytes_max`]: blocks up to 4 MiB
/// (a 2 MiB vLLM block of an 8B model with its header fits) go to slots.
pub const SLOT_FILE_BYTES_DEFAULT: u64 = 4 << 20;
/// The largest [`G3Config::slot_file_bytes_max`] (a slot is read and
/// verified whole into a bounce buffer before it is served by fd).
pub const SLOT_FILE_BYTES_MAX: u64 = 64 << 20;

/// Configuration of a G3 store.
#[derive(Debug, Clone)]
pub struct G3Config {
    /// Directory that holds everything (see the module docs).
    pub root: PathBuf,
    /// Bytes of block files this tier may hold.
    pub capacity_bytes: u64,
    /// Fraction of capacity above which background eviction starts.
    pub high_watermark: f64,
    /// Fraction of capacity eviction brings usage down to.
    pub low_watermark: f64,
    /// I/O engine to use.
    pub engine: EngineKind,
    /// Block operations in flight at once (1..=[`IO_DEPTH_MAX`]); each keeps
    /// up to 8 requests of 1 MiB in flight.
    pub io_depth: usize,
    /// Bytes of aligned write buffers allocated at open (at least 1 MiB).
    pub buffer_pool_bytes: u64,
    /// Live leases at most.
    pub leases_max: usize,
    /// Longest lease, in milliseconds (longer requests are cut to this).
    pub lease_ttl_max_ms: u64,
    /// Bytes that pins may protect from eviction.
    pub pinned_budget_bytes: u64,
    /// How block files are made durable.
    pub sync_mode: SyncMode,
    /// Bytes `quarantine/` may hold (capped at half of `capacity_bytes`);
    /// the oldest entries are deleted past it. Quarantined bytes count
    /// against `capacity_bytes`, so a client or disk producing corrupt
    /// blocks cannot fill the filesystem behind the tier's back.
    pub quarantine_max_bytes: u64,
    /// Files `quarantine/` may hold (at least 1).
    pub quarantine_max_files: usize,
    /// Bytes of evicted block files kept in `recycle/` for later offloads
    /// of the same size to overwrite in place (recycle.rs; 0: off). They
    /// count against `capacity_bytes` (dropped before any block is
    /// evicted for room), so this is a share of the tier, not extra disk;
    /// capped at half of `capacity_bytes`.
    pub recycle_pool_bytes: u64,
    /// Files `recycle/` may keep. A start after a crash reads one header
    /// per pooled file (a recycled block whose rename a power cut took
    /// back is found only so), so this bounds what the pool adds to
    /// recovery whatever the block size (4096 cold header reads took 1.0 s
    /// on the 2-core VM's virtual disk while it compiled; an NVMe is
    /// faster); the pool only has to cover the lag between an eviction and
    /// the offloads that reuse its file.
    pub recycle_pool_files_max: usize,
    /// Bytes of evicted files in `recycle/` whose retirement is not yet
    /// durable. Past it the pool is settled at once (an fsync of
    /// `recycle/` and of the shard directories, then the headers are
    /// blanked). An unsettled file still carries its block's header, so a
    /// start after a crash verifies it in full and puts the block back:
    /// this bounds the bytes such a start reads and hashes (otherwise
    /// only settled by the next offload of the same file size, so a bulk
    /// eviction could leave the whole pool, up to half of capacity, to
    /// verify).
    pub recycle_unsettled_bytes_max: u64,
    /// Blocks whose file is at most this long live in a slot of a shared
    /// slab file (slots.rs) rather than a file of their own: one flush of
    /// the slab per group of writers, no create, rename or directory
    /// fsync per block, a read is one positioned read. 0: every block has
    /// its own file. Larger blocks keep their file (the mount hands those
    /// to the kernel for passthrough reads). At most
    /// [`SLOT_FILE_BYTES_MAX`].
    pub slot_file_bytes_max: u64,
    /// How long the last block of a batch stays an open tail (spare.rs;
    /// zero: none).
    pub open_tail_grace: std::time::Duration,
    /// Written into the directory's lock file beside the pid (kvtierd:
    /// `socket <path>`), so that a second daemon refused the directory
    /// names the holder (dir_lock.rs).
    pub owner_note: String,
}

/// How a block file's data is made durable before its rename.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SyncMode {
    /// One `syncfs` per window shared by every writer whose file was
    /// written when it began, across requests and clients (group.rs
    /// `FlushWindow`): a disk without FUA pays one cache flush per window
    /// instead of one per block. Only on filesystems whose `syncfs` flushes
    /// the device (ext4, XFS, btrfs, F2FS; tmpfs keeps nothing anyway);
    /// elsewhere (FUSE, network filesystems) the store runs `Auto`.
    /// Opt-in: measured no faster than `Auto` here (docs/BENCHMARKS.md,
    /// "Why the unmet targets are unmet"), whose concurrent flushes the kernel already
    /// merges.
    Group,
    /// The default, per block, as measured best (docs/BENCHMARKS.md):
    /// `ODsync` for files that fit one request (1 MiB), `Fdatasync` for
    /// larger ones.
    #[default]
    Auto,
    /// One `fdatasync` after all chunks are written.
    Fdatasync,
    /// The temp file is opened `O_DSYNC`: every write request is durable
    /// when it completes, no separate flush.
    ODsync,
}

impl G3Config {
    /// Defaults for `root` with `capacity_bytes`.
    pub fn new(root: impl Into<PathBuf>, capacity_bytes: u64) -> Self {
        G3Config {
            root: root.into(),
            capacity_bytes,
            high_watermark: 0.95,
            low_watermark: 0.85,
            engine: EngineKind::Auto,
            io_depth: 16,
            buffer_pool_bytes: 64 << 20,
            leases_max: 65536,
            lease_ttl_max_ms: 60_000,
            pinned_budget_bytes: capacity_bytes / 2,
            sync_mode: SyncMode::Auto,
            quarantine_max_bytes: capacity_bytes / 32,
            quarantine_max_files: 256,
            recycle_pool_bytes: capacity_bytes / 2,
            recycle_pool_files_max: 4096,
            recycle_unsettled_bytes_max: 256 << 20,
            slot_file_bytes_max: SLOT_FILE_BYTES_DEFAULT,
            open_tail_grace: super::spare::TAIL_GRACE,
            owner_note: String::new(),
        }
    }

    /// The quarantine's byte bound in force: `quarantine_max_bytes`, at
    /// most half of capacity.
    pub(super) fn quarantine_bound_bytes(&self) -> u64 {
        self.quarantine_max_bytes.min(self.capacity_bytes / 2)
    }

    /// The recycle pool's byte bound in force: `recycle_pool_bytes`, at
    /// most half of capacity.
    pub(super) fn recycle_bound_bytes(&self) -> u64 {
        self.recycle_pool_bytes.min(self.capacity_bytes / 2)
    }

    pub(super) fn validate(&self) -> Result<()> {
        let bad = |key: &str, problem: String| {
            Err(Error::Config {
                key: format!("g3.{key}"),
                problem,
            })
        };
        if !(self.low_watermark > 0.0
            && self.low_watermark < self.high_watermark
            && self.high_watermark <= 1.0)
        {
            return bad(
                "high_watermark",
                format!(
                    "need 0 < low ({}) < high ({}) <= 1",
                    self.low_watermark, self.high_watermark
                ),
            );
        }
        if self.io_depth == 0 || self.io_depth > IO_DEPTH_MAX {
            return bad(
                "io_depth",
                format!("{} is not in 1..={IO_DEPTH_MAX}", self.io_depth),
            );
        }
        if self.buffer_pool_bytes < CHUNK_BYTES as u64 || self.buffer_pool_bytes > 16 << 30 {
            return bad(
                "buffer_pool_bytes",
                format!("{} is not in 1 MiB..=16 GiB", self.buffer_pool_bytes),
            );
        }
        if self.capacity_bytes < 1 << 16 {
            return bad("capacity_bytes", "at least 64 KiB".into());
        }
        if self.quarantine_max_files == 0 {
            return bad("quarantine_max_files", "at least 1".into());
        }
        if self.leases_max == 0 {
            return bad("leases_max", "at least 1".into());
        }
        if self.slot_file_bytes_max > SLOT_FILE_BYTES_MAX {
            return bad(
                "slot_file_bytes_max",
                format!(
                    "{} is more than {SLOT_FILE_BYTES_MAX}",
                    self.slot_file_bytes_max
                ),
            );
        }
        Ok(())
    }
}
