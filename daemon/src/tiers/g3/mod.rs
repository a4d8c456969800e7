//! G3: the local NVMe tier. Persistent, crash-consistent, at disk speed.
//!
//! Layers (foyer's split): [`engine`] moves bytes (io_uring or
//! pread/pwrite, behind [`engine::IoEngine`]); [`index`] knows what is
//! stored (redb + an in-memory map); the role modules below give them cache
//! semantics (put, read, lease, pin, evict); [`recover`] rebuilds the index
//! from the files at open; [`reclaimer`] evicts; [`fault`] injects I/O
//! errors for tests.
//!
//! This file is the facade: the [`G3Store`] struct, `open`, and the public
//! names. The role modules each add one `impl G3Store` block:
//! - `config`: [`G3Config`], [`SyncMode`], their validation.
//! - `write`: the offload path (`put_block`, `put_blocks`: plan, make room,
//!   write in parallel, group commit, publish in input order).
//! - `durable`: one block file made durable (temp write, flush, no-replace
//!   rename, shard directories) and the group commit's fsyncs and commit.
//! - `recycle`: the pool of evicted files reused by the write path (no
//!   extent allocation, no directory fsync before the ack).
//! - `slots`: the slab files and their slots' states; `slot_io` the
//!   store's I/O on them (write and flush, read, release, crash scan).
//! - `pool`: the aligned write buffers and the read path's bounce buffers. `fsops`: directory fsync,
//!   no-replace rename, O_DIRECT probe.
//! - `seam`: the filesystem seam (`G3Fs`, `RealFs`, the named sync sites);
//!   every operation that changes the disk goes through `G3Store::fs`.
//!   `powerloss`: the crash simulator behind it (tests).
//! - `read`: the onboard path (`read_into`, `open_for_read`). `verify`: the
//!   streaming block verifier and `verify_all`. `quarantine`: blocks that
//!   failed verification.
//! - `lookup`: `lookup_prefix`, `stat`, `list`, `namespaces` (memory only,
//!   but `stat`'s one record). `leases` and `hints`: leases, pins, priority,
//!   the in-G4 flag.
//! - `remove`: delete and forget (a forced removal takes the block's
//!   now-unreachable descendants along). [`reclaimer`]: eviction,
//!   `make_room` and the background thread. `chains`: the parent links of
//!   held blocks (leaves first). `spare`: what eviction must not take now
//!   (a batch's parents, open chain tails). `close`: shutdown and the clean marker.
//! - `events`: [`G3Event`] and the sink. `stats`: counters, [`G3Stats`].
//!   `block_tier`: the [`crate::base::tier::BlockTier`] impl.
//!
//! On disk, under `root`:
//! - `blocks/<block_path(ns, key)>`: one block file per block (the same
//!   name the mount and G4 use), 4096-byte header + padded payload.
//! - `tmp/`: writes in progress; anything here at open is removed.
//! - `quarantine/`: blocks that failed verification, kept for inspection.
//! - `slots/<file pages>.slab`: blocks of up to `slot_file_bytes_max`,
//!   each in a slot of a slab shared by the blocks of its file length
//!   (`slots`, `slot_io`).
//! - `recycle/`: evicted block files kept for offloads of the same size to
//!   overwrite in place (`recycle`; named `<file_len>.<pid>.<seq>`); one
//!   with a valid header whose `blocks/` name is absent at open is an
//!   acknowledged block whose rename a power cut took back: put back.
//! - `index.redb`: the persistent index (a cache of the files).
//!
//! Architecture invariant: a block is visible (index, lookups, events) only
//! after its file and directory entry are durable; bytes leave this module
//! only after their header, length, padding and payload checksum verified.
//!
//! Architecture invariant (chains): every held block is reachable from a
//! held root through held parents. A put whose parent is not held is
//! refused; eviction takes only leaves (no held child) and never a batch's
//! parent or a chain's open tail; a forced removal takes the descendants
//! with it.

pub mod access_order;
mod block_tier;
mod chains;
mod close;
mod config;
pub mod dir_lock;
mod dir_set;
mod durable;
pub mod engine;
mod events;
#[cfg(any(test, feature = "testkit"))]
pub mod fault;
mod fsops;
mod group;
mod hints;
pub mod index;
mod leases;
mod lookup;
mod pool;
#[cfg(any(test, feature = "testkit"))]
pub mod powerloss;
mod presence;
mod quarantine;
mod read;
mod read_batch;
pub mod reclaimer;
pub mod recover;
mod recycle;
mod remove;
pub mod seam;
mod slot_io;
mod slots;
mod snapshot;
mod spare;
mod stats;
#[cfg(test)]
mod tests;
mod verify;
pub(crate) mod walk;
mod write;

use crate::base::error::{Error, Result};
use crate::tiers::policy::EvictionPolicy;
use engine::{EngineKind, IoEngine, PreadEngine, UringEngine};
use index::{DiskIndex, MemIndex};
use kvtier_client::{block_path, BlockKey, NamespaceId};
use leases::Leases;
use pool::{BouncePool, BufferPool};
use stats::Counters;
use std::collections::{HashMap, HashSet};
use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex, RwLock};

pub use config::{G3Config, SyncMode, IO_DEPTH_MAX};
pub use engine::EngineKind as G3EngineKind;
pub use events::{EventSink, G3Event, RemoveReason};
pub use leases::LeaseId;
pub use lookup::BlockInfo;
pub use recover::{RecoveryReport, CLEAN_MARKER};
pub use recycle::RecycleCounts;
pub use snapshot::SNAPSHOT_FILE;
pub use stats::G3Stats;
pub use verify::VerifyReport;
pub use write::{PutItem, PutMeta};

/// The G3 store. Thread-safe; share it as `Arc<G3Store>`.
pub struct G3Store {
    cfg: G3Config,
    blocks_dir: PathBuf,
    tmp_dir: PathBuf,
    quarantine_dir: PathBuf,
    /// Evicted files kept for reuse (recycle.rs).
    recycle_dir: PathBuf,
    recycle: Mutex<recycle::RecyclePool>,
    /// Blocks of up to `slot_file_bytes_max` in slab slots (slots.rs).
    slots: slots::Slots,
    /// One slab created at a time (slot_io.rs `slab_for`).
    slot_create: Mutex<()>,
    /// Written while pending retirements are made durable (one at a
    /// time); read by a recycled write from noting its new directory to
    /// its rename out of `recycle/` (recycle.rs: the order of fsyncs).
    recycle_settle: RwLock<()>,
    engine: Arc<dyn IoEngine>,
    /// Every file operation that changes the disk (seam.rs).
    fs: Arc<dyn seam::G3Fs>,
    direct_ok: bool,
    mem: RwLock<MemIndex>,
    /// Shared with the deferred policy touches of onboard reads
    /// (access_order.rs), which run after the read that made them.
    policy: Arc<Mutex<Box<dyn EvictionPolicy>>>,
    disk: DiskIndex,
    pool: BufferPool,
    bounce: BouncePool,
    leases: Mutex<Leases>,
    poisoned: Mutex<Option<String>>,
    closed: AtomicBool,
    sink: RwLock<Option<EventSink>>,
    counters: Counters,
    known_dirs: Mutex<dir_set::DirSet>,
    /// Shard directories with an unlink (delete, eviction, quarantine)
    /// not yet made durable: `close` fsyncs them before the clean marker,
    /// else a file could come back after a power cut that the trusted
    /// index no longer lists.
    unsynced_removals: Mutex<HashSet<PathBuf>>,
    /// Shard directories a removal may have left empty (remove.rs
    /// `remove_empty_dirs`).
    maybe_empty: Mutex<HashSet<PathBuf>>,
    /// Ids puts are writing now (between plan and publish), with how many
    /// puts claim each: the first writes, the others join it (write.rs),
    /// so a name found in `blocks/` for a claimed id that the index lacks
    /// is an orphan.
    writing: Mutex<HashMap<u64, u32>>,
    /// Striped by id: held while a block's name in `blocks/` and its index
    /// entry change together (a removal's unlink and forget, a put's
    /// rename into place), so that a put of the same key never lands
    /// between a removal's two steps (remove.rs, `name_lock`).
    name_locks: Vec<Mutex<()>>,
    group: group::GroupCommit,
    /// The data flush shared by writers (sync mode `Group`).
    flush_window: group::FlushWindow,
    /// `cfg.sync_mode`, or `Auto` where `Group` is not safe
    /// (seam.rs `G3Fs::syncfs_durable`).
    sync_mode: SyncMode,
    write_gate: RwLock<()>,
    reclaim: Arc<reclaimer::Signal>,
    reclaimer: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// What eviction must not take now: the parents of batches being
    /// written, the open tails of chains (spare.rs).
    spare: spare::Spare,
    /// Eviction prefers blocks already in G4 (G4 write-through is on), and
    /// counts the ones that go before their upload.
    prefer_uploaded: AtomicBool,
    /// What recovery found at open.
    pub recovery: Mutex<RecoveryReport>,
    /// This store's exclusive hold on `root` (dir_lock.rs): taken before
    /// anything in it is read or moved, released on drop (after `disk`,
    /// declared above it, closed the index).
    _dir_lock: Option<dir_lock::DirLock>,
}

impl std::fmt::Debug for G3Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("G3Store")
            .field("root", &self.cfg.root)
            .field("engine", &self.engine.name())
            .finish()
    }
}

pub(crate) fn now_s() -> u32 {
    if let Some(t) = SIM_CLOCK_S.with(std::cell::Cell::get) {
        return t;
    }
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as u32)
        .unwrap_or(0)
}

thread_local! {
    /// The simulated clock of this thread (`None`: the wall clock).
    static SIM_CLOCK_S: std::cell::Cell<Option<u32>> = const { std::cell::Cell::new(None) };
}

/// Test seam (the deterministic simulation, daemon/tests/sim): G3 calls
/// made on this thread read `t` (unix seconds) as the time, for access
/// stamps, LRU order at recovery and pin expiry; `None` restores the
/// wall clock. Per thread, so tests running beside it are unaffected.
#[doc(hidden)]
pub fn set_sim_clock_s(t: Option<u32>) {
    SIM_CLOCK_S.with(|c| c.set(t));
}

fn lock_err(what: &'static str) -> Error {
    Error::InvalidInput {
        what,
        reason: "a thread panicked while holding this lock".into(),
    }
}

impl G3Store {
    /// Opens (creating if needed) the store at `cfg.root`: validates the
    /// config, picks the engine (logged), probes O_DIRECT on the filesystem,
    /// allocates the buffer pool, runs recovery (see [`recover`]) and starts
    /// the background reclaimer.
    pub fn open(cfg: G3Config, policy: Box<dyn EvictionPolicy>) -> Result<Arc<G3Store>> {
        cfg.validate()?;
        let engine: Arc<dyn IoEngine> = match cfg.engine {
            EngineKind::Pread => Arc::new(PreadEngine),
            EngineKind::Uring => {
                Arc::new(UringEngine::new(cfg.io_depth).map_err(|e| Error::Config {
                    key: "g3.engine".into(),
                    problem: format!("io_uring refused by this kernel: {e}"),
                })?)
            }
            EngineKind::Auto => match UringEngine::new(cfg.io_depth) {
                Ok(u) => Arc::new(u),
                Err(e) => {
                    tracing::warn!(error = %e, "g3: io_uring refused, falling back to pread/pwrite");
                    Arc::new(PreadEngine)
                }
            },
        };
        Self::open_with_engine(cfg, policy, engine)
    }

    /// Like [`G3Store::open`] with a given engine (a [`fault::FaultEngine`]
    /// in tests).
    pub fn open_with_engine(
        cfg: G3Config,
        policy: Box<dyn EvictionPolicy>,
        engine: Arc<dyn IoEngine>,
    ) -> Result<Arc<G3Store>> {
        Self::open_with_fs(cfg, policy, engine, Arc::new(seam::RealFs))
    }

    /// Like [`G3Store::open_with_engine`] over a given filesystem seam (a
    /// `powerloss::PowerLossFs` in the crash harness; its
    /// `PowerLossFs::engine` wraps `engine`).
    pub fn open_with_fs(
        cfg: G3Config,
        policy: Box<dyn EvictionPolicy>,
        engine: Arc<dyn IoEngine>,
        fs: Arc<dyn seam::G3Fs>,
    ) -> Result<Arc<G3Store>> {
        cfg.validate()?;
        let blocks_dir = cfg.root.join("blocks");
        let tmp_dir = cfg.root.join("tmp");
        let quarantine_dir = cfg.root.join("quarantine");
        let recycle_dir = cfg.root.join("recycle");
        let slots_dir = cfg.root.join("slots");
        let lock = prepare_dirs(
            &cfg,
            fs.as_ref(),
            [
                &blocks_dir,
                &tmp_dir,
                &quarantine_dir,
                &recycle_dir,
                &slots_dir,
            ],
        )?;
        // A full filesystem gets the index's reserve back before anything
        // here writes (a node starts on a full disk, index.rs).
        index::IndexReserve::new(&cfg.root, cfg.capacity_bytes).release_if_short();
        let direct_ok = fsops::probe_direct(fs.as_ref(), &tmp_dir)?;
        let sync_mode = match cfg.sync_mode {
            SyncMode::Group if !fs.syncfs_durable(&tmp_dir, direct_ok) => {
                tracing::warn!(dir = %tmp_dir.display(), direct_io = direct_ok, "g3: a shared syncfs is not trusted to make block data durable here (no O_DIRECT, or a filesystem whose syncfs may not flush the device); flushing each block's data instead of one flush per window");
                SyncMode::Auto
            }
            m => m,
        };
        let (mut disk, index_rebuilt) = recover::open_index(fs.as_ref(), &cfg.root)?;
        disk.attach(fs.clone(), cfg.capacity_bytes);
        let pool = BufferPool::new(cfg.buffer_pool_bytes)?;
        let store = Arc::new(G3Store {
            blocks_dir,
            tmp_dir,
            quarantine_dir,
            recycle_dir,
            recycle: Mutex::new(recycle::RecyclePool::default()),
            slots: slots::Slots::new(slots_dir, cfg.slot_file_bytes_max),
            slot_create: Mutex::new(()),
            recycle_settle: RwLock::new(()),
            engine,
            fs,
            direct_ok,
            mem: RwLock::new(MemIndex::default()),
            policy: Arc::new(Mutex::new(policy)),
            disk,
            pool,
            bounce: BouncePool::new(cfg.io_depth),
            leases: Mutex::new(Leases {
                live: HashMap::new(),
            }),
            poisoned: Mutex::new(None),
            closed: AtomicBool::new(false),
            sink: RwLock::new(None),
            counters: Counters::default(),
            known_dirs: Mutex::new(dir_set::DirSet::default()),
            unsynced_removals: Mutex::new(HashSet::new()),
            maybe_empty: Mutex::new(HashSet::new()),
            writing: Mutex::new(HashMap::new()),
            name_locks: (0..remove::NAME_LOCKS).map(|_| Mutex::new(())).collect(),
            group: group::GroupCommit::default(),
            flush_window: group::FlushWindow::default(),
            sync_mode,
            write_gate: RwLock::new(()),
            reclaim: Arc::new(reclaimer::Signal::default()),
            reclaimer: Mutex::new(None),
            spare: spare::Spare::with_grace(cfg.open_tail_grace),
            prefer_uploaded: AtomicBool::new(false),
            recovery: Mutex::new(RecoveryReport::default()),
            _dir_lock: lock,
            cfg,
        });
        let mut report = store.recover()?;
        report.adopted += store.scan_recycled(report.clean_start)?;
        store.trim_quarantine();
        store.remove_empty_dirs_at_open();
        report.index_rebuilt = index_rebuilt;
        tracing::info!(
            root = %store.cfg.root.display(),
            engine = store.engine.name(),
            direct_io = direct_ok,
            blocks = report.indexed + report.adopted,
            adopted = report.adopted,
            dropped = report.dropped,
            temp_removed = report.temp_removed,
            quarantined = report.quarantined,
            set_aside = report.set_aside,
            index_rebuilt = report.index_rebuilt,
            clean_start = report.clean_start,
            from_snapshot = report.from_snapshot,
            ms = report.elapsed_ms,
            "g3 opened"
        );
        if let Ok(mut r) = store.recovery.lock() {
            *r = report;
        }
        store.disk.reserve.replenish();
        let h = reclaimer::spawn(&store);
        if let Ok(mut slot) = store.reclaimer.lock() {
            *slot = h;
        }
        store.maybe_reclaim();
        Ok(store)
    }

    /// Whether the filesystem under the store is full: less free than the
    /// index's reserve, or the reserve in use (or an I/O error keeps the
    /// index from being written).
    /// Offloads are answered `no_space` until eviction or the operator
    /// frees room.
    pub fn disk_full(&self) -> bool {
        !self.disk.reserve.held() || self.disk.broken() || self.disk.reserve.short()
    }

    /// The engine that runs (`io_uring` or `pread`).
    pub fn engine_name(&self) -> &'static str {
        self.engine.name()
    }

    /// Group commits since open: (groups, writes in them). Their quotient
    /// is how many writes shared one directory fsync and index commit.
    pub fn group_commit_counts(&self) -> (u64, u64) {
        self.group.counts()
    }

    /// Data flushes of the `Group` sync mode since open: (flushes, writes
    /// that waited on them). Their quotient is the writes one flush
    /// covered.
    pub fn data_flush_counts(&self) -> (u64, u64) {
        self.flush_window.counts()
    }

    /// The sync mode that runs (`Group` falls back to `Auto` on a
    /// filesystem whose syncfs is not trusted).
    pub fn sync_mode(&self) -> SyncMode {
        self.sync_mode
    }

    /// The configuration.
    pub fn config(&self) -> &G3Config {
        &self.cfg
    }

    /// Where the block's file is (whether or not it exists).
    pub fn block_file_path(&self, ns: &NamespaceId, key: &BlockKey) -> PathBuf {
        self.blocks_dir.join(block_path(ns, key))
    }

    /// Where a held block's bytes are on disk: its own file at offset 0,
    /// or its slab at its slot's offset (slots.rs). `None`: not held.
    pub fn block_location(&self, ns: &NamespaceId, key: &BlockKey) -> Option<(PathBuf, u64)> {
        let mem = self.mem.read().ok()?;
        let (_, e) = mem.get(ns, key)?;
        match e.slotted() {
            None => Some((self.block_file_path(ns, key), 0)),
            Some(slot) => Some((
                self.slots.path_of(e.file_pages),
                u64::from(slot) * e.file_len(),
            )),
        }
    }
}

/// Creates the root and its `dirs` (each missing directory made durable by
/// an fsync of its parent), takes the directory's owner lock, and checks
/// that each of `dirs` is a directory of its own on the root's filesystem.
fn prepare_dirs(
    cfg: &G3Config,
    fs: &dyn seam::G3Fs,
    dirs: [&PathBuf; 5],
) -> Result<Option<dir_lock::DirLock>> {
    // Directories this open creates are made durable (an fsync of
    // each one's parent) before any block goes in: a block's own
    // fsyncs reach only up to `blocks/`, so a fresh root or `blocks/`
    // lost to a power cut would take every block with it.
    let mut created: Vec<PathBuf> = Vec::new();
    created.extend(
        cfg.root
            .ancestors()
            .take_while(|a| !a.exists())
            .map(std::path::Path::to_path_buf),
    );
    fs.create_dir_all(&cfg.root)
        .map_err(|e| Error::io("creating", &cfg.root, e))?;
    // One owner per directory, before anything in it is read, created
    // or moved: a second daemon must not rebuild (or set aside) the
    // index the first one is using.
    let lock = if fs.owner_lock() {
        Some(dir_lock::DirLock::take(&cfg.root, &cfg.owner_note)?)
    } else {
        None
    };
    for d in dirs {
        created.extend(
            d.ancestors()
                .take_while(|a| !a.exists())
                .map(std::path::Path::to_path_buf),
        );
        fs.create_dir_all(d)
            .map_err(|e| Error::io("creating", d, e))?;
    }
    let mut parents: Vec<PathBuf> = created
        .iter()
        .filter_map(|d| d.parent().map(std::path::Path::to_path_buf))
        .collect();
    parents.sort_unstable();
    parents.dedup();
    for p in parents {
        fs.sync_dir(&p, seam::SyncSite::OpenDirFsync)
            .map_err(|e| Error::io("flushing directory", &p, e))?;
    }
    // Recovery, trimming and the recycle scan act on these: each must
    // be a directory of its own, not a link out of the data directory
    // nor another filesystem (walk.rs).
    let root_dev = std::fs::metadata(&cfg.root)
        .map_err(|e| Error::io("stat", &cfg.root, e))?
        .dev();
    for d in dirs {
        walk::check_own_dir(d, root_dev).map_err(|e| Error::io("checking", d, e))?;
    }
    Ok(lock)
}
