//! G3: the local NVMe tier. Persistent, crash-consistent, at disk speed.
//!
//! Layers (foyer's split): [`engine`] moves bytes (io_uring or
//! pread/pwrite, behind [`engine::IoEngine`]); [`index`] knows what is
//! stored (redb + an in-memory map); this module gives them cache semantics
//! (put, read, lease, pin, evict); [`recover`] rebuilds the index from the
//! files at open; [`reclaimer`] evicts in the background; [`fault`] injects
//! I/O errors for tests.
//!
//! On disk, under `root`:
//! - `blocks/<block_path(ns, key)>`: one block file per block (the same
//!   name the mount and G4 use), 4096-byte header + padded payload.
//! - `tmp/`: writes in progress; anything here at open is removed.
//! - `quarantine/`: blocks that failed verification, kept for inspection.
//! - `index.redb`: the persistent index (a cache of the files).
//!
//! Architecture invariant: a block is visible (index, lookups, events) only
//! after its file and directory entry are durable; bytes leave this module
//! only after their header, length, padding and payload checksum verified.

pub mod engine;
pub mod fault;
mod group;
pub mod index;
mod presence;
pub mod reclaimer;
pub mod recover;
mod snapshot;
#[cfg(test)]
mod tests;

use crate::error::{Error, Result};
use crate::policy::{BlockMeta, EvictionPolicy};
use crate::tier::{Block, BlockTier, Lookup, MissReason, PutOutcome};
use engine::{AlignedBuf, EngineKind, IoEngine, PreadEngine, UringEngine, CHUNK_BYTES};
use index::{digest, DiskIndex, Entry, MemIndex, Record, FLAG_EPHEMERAL, FLAG_IN_G4, PIN_FOREVER};
use kvtier_client::block::HEADER_BYTES;
use kvtier_client::{block_path, BlockHeader, BlockKey, Hints, NamespaceId, Tier};
use std::collections::{HashMap, HashSet};
use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, RwLock};
use std::time::{Duration, Instant};

pub use engine::EngineKind as G3EngineKind;
pub use recover::{RecoveryReport, CLEAN_MARKER};
pub use snapshot::SNAPSHOT_FILE;

/// Most block operations in flight at once (rings in the io_uring pool).
pub const IO_DEPTH_MAX: usize = 256;
/// Pool buffers one write takes at most.
const BUFS_PER_WRITE: usize = 4;

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
}

/// How a block file's data is made durable before its rename.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SyncMode {
    /// As measured best here (docs/BENCHMARKS.md): `ODsync` for files that
    /// fit one request (1 MiB), `Fdatasync` for larger ones.
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
        }
    }

    fn validate(&self) -> Result<()> {
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
        if self.leases_max == 0 {
            return bad("leases_max", "at least 1".into());
        }
        Ok(())
    }
}

/// What a put knows beyond the header.
#[derive(Debug, Clone, Copy, Default)]
pub struct PutMeta {
    /// The block before this one in its chain.
    pub parent: Option<BlockKey>,
    /// Engine hints (pinned, priority, ephemeral).
    pub hints: Hints,
}

/// One block of a [`G3Store::put_blocks`] batch.
#[derive(Debug, Clone, Copy)]
pub struct PutItem<'a> {
    /// The block's header (its namespace must be the batch's).
    pub header: &'a BlockHeader,
    /// The payload (any slice, shared memory too).
    pub payload: &'a [u8],
    /// Parent and hints.
    pub meta: PutMeta,
}

/// A block's state as [`G3Store::stat`] reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockInfo {
    /// File length (header + padded payload).
    pub file_len: u64,
    /// Payload length.
    pub payload_len: u64,
    /// Payload checksum.
    pub payload_blake3: [u8; 32],
    /// When first stored.
    pub created_unix_ms: u64,
    /// Reads served.
    pub hits: u32,
    /// Last read or write (second resolution).
    pub last_access_unix_ms: u64,
    /// A pin protects it now.
    pub pinned: bool,
    /// Priority hint.
    pub priority: u8,
    /// Ephemeral hint.
    pub ephemeral: bool,
    /// Live leases.
    pub leases: u16,
    /// A copy exists in G4.
    pub in_g4: bool,
}

/// A lease: protects a block from eviction until released or expired.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LeaseId(pub u64);

/// Why a block left the tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RemoveReason {
    /// Evicted for capacity.
    Evicted,
    /// Deleted on request.
    Deleted,
    /// Failed verification or its file vanished.
    Corrupt,
}

/// A KV event for routers and the G4 write-through.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum G3Event {
    /// A block became durable and visible.
    Stored {
        /// Namespace.
        ns: NamespaceId,
        /// Key.
        key: BlockKey,
        /// Parent from the put.
        parent: Option<BlockKey>,
        /// File length.
        file_len: u64,
    },
    /// A block left the tier.
    Removed {
        /// Namespace.
        ns: NamespaceId,
        /// Key.
        key: BlockKey,
        /// Why.
        reason: RemoveReason,
    },
}

/// Receives events, synchronously, on the thread that caused them.
pub type EventSink = Arc<dyn Fn(G3Event) + Send + Sync>;

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
    /// Writes that failed.
    pub write_errors: u64,
    /// `io_uring` or `pread`.
    pub engine: &'static str,
    /// Whether block files use O_DIRECT.
    pub direct_io: bool,
    /// Why writes are refused, if they are.
    pub read_only: Option<String>,
}

/// Result of [`G3Store::verify_all`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct VerifyReport {
    /// Blocks checked.
    pub checked: u64,
    /// Blocks that verified.
    pub ok: u64,
    /// Blocks quarantined.
    pub corrupt: u64,
    /// Blocks whose file vanished (dropped from the index).
    pub vanished: u64,
}

#[derive(Default)]
struct Counters {
    hits: AtomicU64,
    misses: AtomicU64,
    evictions: AtomicU64,
    quarantined: AtomicU64,
    write_errors: AtomicU64,
    seq: AtomicU64,
}

struct Leases {
    live: HashMap<u64, (u64, Instant)>,
}

/// Aligned write buffers allocated once at open.
struct BufferPool {
    free: Mutex<Vec<AlignedBuf>>,
    freed: Condvar,
}

impl BufferPool {
    fn new(total_bytes: u64) -> Result<Self> {
        let n = (total_bytes / CHUNK_BYTES as u64).max(1) as usize;
        let mut v = Vec::with_capacity(n);
        for _ in 0..n {
            v.push(
                AlignedBuf::rounded(CHUNK_BYTES)
                    .map_err(|e| Error::io("allocating", "buffer pool", e))?,
            );
        }
        Ok(BufferPool {
            free: Mutex::new(v),
            freed: Condvar::new(),
        })
    }

    /// Takes 1..=n buffers, waiting while none is free.
    fn take(&self, n: usize) -> Vec<AlignedBuf> {
        let Ok(mut free) = self.free.lock() else {
            return Vec::new();
        };
        while free.is_empty() {
            free = match self.freed.wait(free) {
                Ok(f) => f,
                Err(_) => return Vec::new(),
            };
        }
        let k = n.min(free.len());
        let at = free.len() - k;
        free.split_off(at)
    }

    fn give(&self, bufs: Vec<AlignedBuf>) {
        if let Ok(mut f) = self.free.lock() {
            f.extend(bufs);
        }
        self.freed.notify_all();
    }
}

/// The G3 store. Thread-safe; share it as `Arc<G3Store>`.
pub struct G3Store {
    cfg: G3Config,
    blocks_dir: PathBuf,
    tmp_dir: PathBuf,
    quarantine_dir: PathBuf,
    engine: Arc<dyn IoEngine>,
    direct_ok: bool,
    mem: RwLock<MemIndex>,
    policy: Mutex<Box<dyn EvictionPolicy>>,
    disk: DiskIndex,
    pool: BufferPool,
    leases: Mutex<Leases>,
    poisoned: Mutex<Option<String>>,
    closed: AtomicBool,
    sink: RwLock<Option<EventSink>>,
    counters: Counters,
    known_dirs: Mutex<HashSet<PathBuf>>,
    group: group::GroupCommit,
    write_gate: RwLock<()>,
    reclaim: Arc<reclaimer::Signal>,
    reclaimer: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// What recovery found at open.
    pub recovery: Mutex<RecoveryReport>,
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
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as u32)
        .unwrap_or(0)
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

fn collision(key: &BlockKey) -> Error {
    Error::InvalidInput {
        what: "block key",
        reason: format!(
            "the index digest of {key} collides with another stored block; use another key"
        ),
    }
}

fn lock_err(what: &'static str) -> Error {
    Error::InvalidInput {
        what,
        reason: "a thread panicked while holding this lock".into(),
    }
}

fn is_aligned(p: *const u8) -> bool {
    (p as usize).is_multiple_of(4096)
}

/// Opens a directory and fsyncs it (makes entries in it durable).
fn fsync_dir(dir: &Path) -> std::io::Result<()> {
    File::open(dir)?.sync_all()
}

/// How a read went, before it is turned into a `Lookup`.
enum ReadOutcome {
    Ok(BlockHeader),
    Vanished,
    Corrupt(String),
}

/// An item of a batch that must be written.
struct BatchJob {
    /// Its position in the batch.
    at: usize,
    id: u64,
    check: u64,
}

/// The index record of a freshly written block.
fn record_of(ns: &NamespaceId, it: &PutItem<'_>, now: u32) -> Record {
    Record {
        ns: *ns,
        key: it.header.key,
        payload_len: it.header.payload_len,
        payload_blake3: it.header.payload_blake3,
        created_unix_ms: it.header.created_unix_ms,
        hits: 0,
        last_access_s: now,
        pin_until_s: 0,
        priority: it.meta.hints.priority,
        flags: if it.meta.hints.ephemeral {
            FLAG_EPHEMERAL
        } else {
            0
        },
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
        cfg.validate()?;
        let blocks_dir = cfg.root.join("blocks");
        let tmp_dir = cfg.root.join("tmp");
        let quarantine_dir = cfg.root.join("quarantine");
        for d in [&cfg.root, &blocks_dir, &tmp_dir, &quarantine_dir] {
            std::fs::create_dir_all(d).map_err(|e| Error::io("creating", d, e))?;
        }
        let direct_ok = probe_direct(&tmp_dir)?;
        let disk = DiskIndex::open(&cfg.root.join("index.redb"))?;
        let pool = BufferPool::new(cfg.buffer_pool_bytes)?;
        let store = Arc::new(G3Store {
            blocks_dir,
            tmp_dir,
            quarantine_dir,
            engine,
            direct_ok,
            mem: RwLock::new(MemIndex::default()),
            policy: Mutex::new(policy),
            disk,
            pool,
            leases: Mutex::new(Leases {
                live: HashMap::new(),
            }),
            poisoned: Mutex::new(None),
            closed: AtomicBool::new(false),
            sink: RwLock::new(None),
            counters: Counters::default(),
            known_dirs: Mutex::new(HashSet::new()),
            group: group::GroupCommit::default(),
            write_gate: RwLock::new(()),
            reclaim: Arc::new(reclaimer::Signal::default()),
            reclaimer: Mutex::new(None),
            recovery: Mutex::new(RecoveryReport::default()),
            cfg,
        });
        let report = store.recover()?;
        tracing::info!(
            root = %store.cfg.root.display(),
            engine = store.engine.name(),
            direct_io = direct_ok,
            blocks = report.indexed + report.adopted,
            adopted = report.adopted,
            dropped = report.dropped,
            temp_removed = report.temp_removed,
            quarantined = report.quarantined,
            clean_start = report.clean_start,
            from_snapshot = report.from_snapshot,
            ms = report.elapsed_ms,
            "g3 opened"
        );
        if let Ok(mut r) = store.recovery.lock() {
            *r = report;
        }
        let h = reclaimer::spawn(&store);
        if let Ok(mut slot) = store.reclaimer.lock() {
            *slot = h;
        }
        store.maybe_reclaim();
        Ok(store)
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

    /// The configuration.
    pub fn config(&self) -> &G3Config {
        &self.cfg
    }

    /// Where the block's file is (whether or not it exists).
    pub fn block_file_path(&self, ns: &NamespaceId, key: &BlockKey) -> PathBuf {
        self.blocks_dir.join(block_path(ns, key))
    }

    /// Stores a block. `payload` may be any slice (shared memory too); it is
    /// copied through aligned pool buffers and its checksum is checked
    /// against `header` on the way. Durable (file, its directory entry) and
    /// indexed before `Ok(Stored)`; a present key is `Ok(AlreadyPresent)`
    /// with nothing written. Errors: [`Error::NoSpace`] when the filesystem
    /// is full (reads continue), [`Error::PreviousIo`] after an earlier
    /// flush failure, [`Error::LimitReached`] when capacity is held by
    /// pinned or leased blocks, [`Error::InvalidInput`] for a header that
    /// does not match `ns` or `payload`. A batch of one
    /// ([`G3Store::put_blocks`]).
    pub fn put_block(
        &self,
        ns: &NamespaceId,
        header: &BlockHeader,
        payload: &[u8],
        meta: PutMeta,
    ) -> Result<PutOutcome> {
        let item = PutItem {
            header,
            payload,
            meta,
        };
        self.put_blocks(ns, &[item])
            .pop()
            .unwrap_or_else(|| Err(lock_err("g3 put")))
    }

    /// Stores the blocks of one request: one outcome per item, in input
    /// order, each with [`G3Store::put_block`]'s meaning. The files are
    /// written with up to `io_depth` in flight, then made durable together
    /// (one fsync per distinct shard directory, one index commit, shared
    /// with concurrent writers by the group commit), and only then indexed,
    /// handed to the eviction policy and announced, in input order (a
    /// chain's parent before its child).
    ///
    /// Items fail alone: an invalid or present item does not affect the
    /// others. When the filesystem fills up, the items whose write did not
    /// complete get [`Error::NoSpace`] (no new write starts after the first
    /// one) and the ones written are still stored. A failed directory fsync
    /// or index commit fails every item that was waiting for it: none of
    /// them is reported stored or becomes visible before a restart (then
    /// recovery may adopt their verified files, as for a single put).
    pub fn put_blocks(&self, ns: &NamespaceId, items: &[PutItem<'_>]) -> Vec<Result<PutOutcome>> {
        let mut out: Vec<Option<Result<PutOutcome>>> = items.iter().map(|_| None).collect();
        // Held for the whole batch: `close` takes it exclusively so that no
        // write completes after the clean marker is written.
        let Ok(_gate) = self.write_gate.read() else {
            return items
                .iter()
                .map(|_| Err(lock_err("g3 write gate")))
                .collect();
        };

        // 1. In input order: validate, skip present keys and repeats, and
        //    make room for everything this batch will add.
        enum Planned {
            Write(u64, u64),
            Present,
            Repeat(usize),
        }
        let mut jobs: Vec<BatchJob> = Vec::new();
        let mut first_of: HashMap<u64, usize> = HashMap::new();
        let mut repeats: Vec<(usize, usize)> = Vec::new();
        let mut reserved_bytes = 0u64;
        for (at, it) in items.iter().enumerate() {
            let planned = self.plan_put(ns, it).and_then(|p| {
                let Some((id, check)) = p else {
                    return Ok(Planned::Present);
                };
                if let Some(&first) = first_of.get(&id) {
                    if items[first].header.key != it.header.key {
                        return Err(collision(&it.header.key));
                    }
                    return Ok(Planned::Repeat(first));
                }
                let file_len = it.header.file_len();
                self.make_room(reserved_bytes, file_len)?;
                reserved_bytes += file_len;
                Ok(Planned::Write(id, check))
            });
            match planned {
                Ok(Planned::Write(id, check)) => {
                    first_of.insert(id, at);
                    jobs.push(BatchJob { at, id, check });
                }
                Ok(Planned::Present) => out[at] = Some(Ok(PutOutcome::AlreadyPresent)),
                Ok(Planned::Repeat(first)) => repeats.push((at, first)),
                Err(e) => out[at] = Some(Err(e)),
            }
        }

        // 2. Write, rename into place; up to `io_depth` files at once.
        let full = AtomicBool::new(false);
        let next = AtomicUsize::new(0);
        let write_some = || {
            let mut done: Vec<(usize, Result<Option<PathBuf>>)> = Vec::new();
            loop {
                let k = next.fetch_add(1, Ordering::Relaxed);
                let Some(job) = jobs.get(k) else { break };
                let it = &items[job.at];
                let r = if full.load(Ordering::Acquire) {
                    // Starting more writes on a full filesystem only churns
                    // it; the caller retries after eviction or cleanup.
                    Err(Error::NoSpace {
                        path: self.tmp_dir.clone(),
                        op: "writing (an earlier block of this batch hit a full filesystem)",
                    })
                } else {
                    self.check_writable()
                        .and_then(|()| self.write_durable(ns, it.header, it.payload, job.id))
                };
                if let Err(e) = &r {
                    if matches!(e, Error::NoSpace { .. }) {
                        full.store(true, Ordering::Release);
                    }
                    self.counters.write_errors.fetch_add(1, Ordering::Relaxed);
                }
                done.push((k, r));
            }
            done
        };
        let workers = self.cfg.io_depth.min(jobs.len());
        let mut written: Vec<(usize, Result<Option<PathBuf>>)> = if workers <= 1 {
            write_some()
        } else {
            std::thread::scope(|sc| {
                // A thread that cannot start leaves its share to the others
                // (this one always runs).
                let hs: Vec<_> = (1..workers)
                    .filter_map(|_| {
                        std::thread::Builder::new()
                            .name("g3-batch-writer".into())
                            .spawn_scoped(sc, write_some)
                            .ok()
                    })
                    .collect();
                let mut all = write_some();
                for h in hs {
                    match h.join() {
                        Ok(v) => all.extend(v),
                        Err(_) => tracing::error!("g3: a batch writer thread panicked"),
                    }
                }
                all
            })
        };
        written.sort_unstable_by_key(|(k, _)| *k);

        // 3. Make the renames and records durable together.
        let now = now_s();
        let mut pending = Vec::new();
        let mut renamed: Vec<&BatchJob> = Vec::new();
        for (k, r) in written {
            let Some(job) = jobs.get(k) else { continue };
            let it = &items[job.at];
            match r {
                Ok(Some(dir)) => {
                    pending.push(group::Pending {
                        dir,
                        id: job.id,
                        rec: record_of(ns, it, now),
                    });
                    renamed.push(job);
                }
                Ok(None) => out[job.at] = Some(Ok(PutOutcome::AlreadyPresent)),
                Err(e) => out[job.at] = Some(Err(e)),
            }
        }
        // A job a panicked writer thread took has no outcome: never stored.
        let mut taken = vec![false; items.len()];
        for job in &renamed {
            taken[job.at] = true;
        }
        for job in &jobs {
            if out[job.at].is_none() && !taken[job.at] {
                out[job.at] = Some(Err(lock_err("g3 batch writer")));
            }
        }
        // On an index failure the files are durable and recovery adopts
        // them; until then they are not visible, so the writes are reported
        // failed.
        if let Err(f) = self.group.join(pending, |g| self.commit_group(g)) {
            let index_path = self.cfg.root.join("index.redb");
            for job in &renamed {
                self.counters.write_errors.fetch_add(1, Ordering::Relaxed);
                out[job.at] = Some(Err(f.to_error(&index_path)));
            }
            renamed.clear();
        }

        // 4. Visible, in input order: index, policy, events.
        if !renamed.is_empty() {
            let published = self.publish(ns, items, &renamed, now).is_ok();
            for job in &renamed {
                if !published {
                    out[job.at] = Some(Err(lock_err("g3 index")));
                    continue;
                }
                out[job.at] = Some(Ok(PutOutcome::Stored));
                let it = &items[job.at];
                self.emit(G3Event::Stored {
                    ns: *ns,
                    key: it.header.key,
                    parent: it.meta.parent,
                    file_len: it.header.file_len(),
                });
            }
            self.maybe_reclaim();
        }
        for (at, first) in repeats {
            out[at] = Some(match &out[first] {
                Some(Ok(_)) => Ok(PutOutcome::AlreadyPresent),
                _ => Err(Error::InvalidInput {
                    what: "block key",
                    reason: format!(
                        "{} repeats an earlier item of this batch, which was not stored",
                        items[at].header.key
                    ),
                }),
            });
        }
        out.into_iter()
            .map(|o| o.unwrap_or_else(|| Err(lock_err("g3 put"))))
            .collect()
    }

    /// Checks one item of a batch against `ns` and the index: its (id,
    /// check) digest when it must be written, `None` when it is present.
    fn plan_put(&self, ns: &NamespaceId, it: &PutItem<'_>) -> Result<Option<(u64, u64)>> {
        let header = it.header;
        if header.namespace_id() != *ns {
            return Err(Error::InvalidInput {
                what: "block header",
                reason: format!(
                    "header is for namespace {}, not {ns}",
                    header.namespace_id()
                ),
            });
        }
        if it.payload.len() as u64 != header.payload_len {
            return Err(Error::InvalidInput {
                what: "payload",
                reason: format!(
                    "{} bytes, header says {}",
                    it.payload.len(),
                    header.payload_len
                ),
            });
        }
        self.check_writable()?;
        let key = header.key;
        let (id, check) = digest(ns, &key);
        let found = {
            let mem = self.mem.read().map_err(|_| lock_err("g3 index"))?;
            mem.map.get(&id).map(|e| e.check == check)
        };
        match found {
            None => Ok(Some((id, check))),
            // The digest is not collision resistant: dedup only on the
            // record's full name (an entry without a record, which a
            // failed index commit can leave, keeps the old answer).
            Some(true) => match self.disk.get(id)? {
                Some(r) if r.ns != *ns || r.key != key => Err(collision(&key)),
                _ => Ok(None),
            },
            Some(false) => Err(collision(&key)),
        }
    }

    /// Makes a committed batch visible, in input order: the in-memory
    /// index and the eviction policy (a parent before its child, so the
    /// policy keeps the link).
    fn publish(
        &self,
        ns: &NamespaceId,
        items: &[PutItem<'_>],
        jobs: &[&BatchJob],
        now: u32,
    ) -> Result<()> {
        let mut mem = self.mem.write().map_err(|_| lock_err("g3 index"))?;
        let mut pol = self.policy.lock().map_err(|_| lock_err("g3 policy"))?;
        for job in jobs {
            let it = &items[job.at];
            let file_len = it.header.file_len();
            let mut pin_until_s = 0;
            if it.meta.hints.pinned
                && mem.pinned_bytes(now) + file_len <= self.cfg.pinned_budget_bytes
            {
                pin_until_s = PIN_FOREVER;
            }
            let rec = record_of(ns, it, now);
            mem.insert(
                *ns,
                job.id,
                Entry {
                    check: job.check,
                    file_pages: (file_len / 4096) as u32,
                    hits: AtomicU32::new(0),
                    last_access_s: AtomicU32::new(rec.last_access_s),
                    pin_until_s,
                    leases: 0,
                    priority: rec.priority,
                    flags: rec.flags,
                },
            );
            pol.on_insert(
                job.id,
                BlockMeta {
                    parent: it.meta.parent.map(|p| digest(ns, &p).0),
                    size_bytes: file_len,
                    hints: it.meta.hints,
                },
            );
        }
        Ok(())
    }

    fn check_writable(&self) -> Result<()> {
        if self.closed.load(Ordering::Acquire) {
            return Err(Error::InvalidInput {
                what: "g3 store",
                reason: "closed".into(),
            });
        }
        if let Some(cause) = self.poisoned.lock().map_err(|_| lock_err("g3"))?.clone() {
            return Err(Error::PreviousIo {
                tier: Tier::G3,
                cause,
            });
        }
        Ok(())
    }

    fn poison(&self, cause: String) {
        tracing::error!(%cause, "g3: refusing writes until restart");
        if let Ok(mut p) = self.poisoned.lock() {
            p.get_or_insert(cause);
        }
    }

    /// Writes the temp file, makes it durable and renames it into place.
    /// `Ok(Some(dir))`: renamed into `dir`, whose fsync (group commit) makes
    /// the rename durable; `Ok(None)`: the name already existed.
    fn write_durable(
        &self,
        ns: &NamespaceId,
        header: &BlockHeader,
        payload: &[u8],
        id: u64,
    ) -> Result<Option<PathBuf>> {
        let seq = self.counters.seq.fetch_add(1, Ordering::Relaxed);
        let tmp = self
            .tmp_dir
            .join(format!("{id:016x}.{}.{seq}", std::process::id()));
        let final_path = self.block_file_path(ns, &header.key);
        let mut flags = libc::O_CLOEXEC;
        if self.direct_ok {
            flags |= libc::O_DIRECT;
        }
        let dsync = match self.cfg.sync_mode {
            SyncMode::ODsync => true,
            SyncMode::Fdatasync => false,
            SyncMode::Auto => header.file_len() <= CHUNK_BYTES as u64,
        };
        if dsync {
            flags |= libc::O_DSYNC;
        }
        let file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .custom_flags(flags)
            .open(&tmp)
            .map_err(|e| Error::io("creating", &tmp, e))?;
        let cleanup = |e: Error| {
            let _ = std::fs::remove_file(&tmp);
            e
        };
        let head = header.encode();
        let plen = payload.len() as u64;
        let file_len = header.file_len();
        let mut hasher = blake3::Hasher::new();
        let mut fill = |off: u64, buf: &mut [u8]| {
            // The chunk covers [off, off + buf.len()) of the file.
            let end = off + buf.len() as u64;
            buf.fill(0);
            if off < HEADER_BYTES as u64 {
                let n = (HEADER_BYTES as u64).min(end) - off;
                buf[..n as usize].copy_from_slice(&head[off as usize..(off + n) as usize]);
            }
            let p0 = off.max(HEADER_BYTES as u64);
            let p1 = end.min(HEADER_BYTES as u64 + plen);
            if p0 < p1 {
                let src = &payload
                    [(p0 - HEADER_BYTES as u64) as usize..(p1 - HEADER_BYTES as u64) as usize];
                let own = &mut buf[(p0 - off) as usize..(p1 - off) as usize];
                own.copy_from_slice(src);
                // Hash the daemon's own copy, the bytes that reach the disk:
                // `src` may be a client's shared pages, which it can change
                // between the copy and a hash of them.
                hasher.update(own);
            }
        };
        let mut bufs = self.pool.take(BUFS_PER_WRITE);
        if bufs.is_empty() {
            return Err(cleanup(lock_err("g3 buffer pool")));
        }
        let wrote = self
            .engine
            .write_file(file.as_raw_fd(), file_len, &mut bufs, &mut fill);
        self.pool.give(bufs);
        if let Err(e) = wrote {
            let err = Error::io("writing", &tmp, e);
            if dsync && !matches!(err, Error::NoSpace { .. }) {
                // Under O_DSYNC a failed write may be a failed flush.
                self.poison(format!("O_DSYNC write of {}: {err}", tmp.display()));
            }
            return Err(cleanup(err));
        }
        if hasher.finalize().as_bytes() != &header.payload_blake3 {
            return Err(cleanup(Error::InvalidInput {
                what: "payload",
                reason: format!("checksum does not match the header of block {}", header.key),
            }));
        }
        let synced = if dsync {
            Ok(())
        } else {
            self.engine.sync_data(file.as_raw_fd())
        };
        if let Err(e) = synced {
            let err = Error::io("flushing", &tmp, e);
            if !matches!(err, Error::NoSpace { .. }) {
                self.poison(format!("fdatasync of {}: {err}", tmp.display()));
            }
            return Err(cleanup(err));
        }
        drop(file);
        let dir = final_path
            .parent()
            .unwrap_or(&self.blocks_dir)
            .to_path_buf();
        self.ensure_dir(&dir).map_err(cleanup)?;
        match rename_noreplace(&tmp, &final_path) {
            Ok(()) => {}
            Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {
                let _ = std::fs::remove_file(&tmp);
                return Ok(None);
            }
            Err(e) => return Err(cleanup(Error::io("renaming into place", &final_path, e))),
        }
        Ok(Some(dir))
    }

    /// The leader's half of a group commit: one fsync per distinct shard
    /// directory, then one (non-durable, see index.rs) redb transaction for
    /// every record of the group.
    fn commit_group(&self, items: &[group::Pending]) -> std::result::Result<(), group::Failure> {
        let mut dirs: Vec<&Path> = items.iter().map(|p| p.dir.as_path()).collect();
        dirs.sort_unstable();
        dirs.dedup();
        for dir in dirs {
            if let Err(e) = fsync_dir(dir) {
                self.poison(format!("fsync of directory {}: {e}", dir.display()));
                return Err(group::Failure::Dir {
                    dir: dir.to_path_buf(),
                    errno: e.raw_os_error(),
                    msg: e.to_string(),
                });
            }
        }
        let recs: Vec<(u64, &Record)> = items.iter().map(|p| (p.id, &p.rec)).collect();
        self.disk
            .put(&recs)
            .map_err(|e| group::Failure::Index(e.to_string()))
    }

    /// Creates `blocks/<ns>/<shard>` durably the first time it is needed.
    fn ensure_dir(&self, dir: &Path) -> Result<()> {
        let mut known = self.known_dirs.lock().map_err(|_| lock_err("g3 dirs"))?;
        if known.contains(dir) {
            return Ok(());
        }
        let ns_dir = dir.parent().unwrap_or(&self.blocks_dir);
        for (d, parent) in [(ns_dir, &self.blocks_dir as &Path), (dir, ns_dir)] {
            match std::fs::create_dir(d) {
                Ok(()) => fsync_dir(parent).map_err(|e| {
                    self.poison(format!("fsync of directory {}: {e}", parent.display()));
                    Error::io("flushing directory", parent, e)
                })?,
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(Error::io("creating directory", d, e)),
            }
        }
        known.insert(dir.to_path_buf());
        Ok(())
    }

    /// Evicts synchronously when `incoming` bytes would pass capacity, on
    /// top of `reserved` bytes that earlier items of the same batch will
    /// add.
    fn make_room(&self, reserved: u64, incoming: u64) -> Result<()> {
        let cap = self.cfg.capacity_bytes;
        if incoming > cap {
            return Err(Error::LimitReached {
                what: "g3 capacity_bytes (block larger than the tier)",
                limit: cap,
            });
        }
        let need = reserved.saturating_add(incoming);
        let used = self
            .mem
            .read()
            .map_err(|_| lock_err("g3 index"))?
            .used_bytes;
        if used + need <= cap {
            return Ok(());
        }
        if need <= cap {
            self.evict_to(cap - need);
        }
        let used = self
            .mem
            .read()
            .map_err(|_| lock_err("g3 index"))?
            .used_bytes;
        if used + need > cap {
            return Err(Error::LimitReached {
                what: "g3 capacity_bytes (the rest is pinned, leased or taken by this batch)",
                limit: cap,
            });
        }
        Ok(())
    }

    fn maybe_reclaim(&self) {
        let used = self.mem.read().map(|m| m.used_bytes).unwrap_or(0);
        if used as f64 > self.cfg.high_watermark * self.cfg.capacity_bytes as f64 {
            self.reclaim.wake();
        }
    }

    fn emit(&self, ev: G3Event) {
        let sink = self.sink.read().ok().and_then(|s| s.clone());
        if let Some(s) = sink {
            s(ev);
        }
    }

    /// Reads a whole block file into `dst` (`dst.len()` at least the file
    /// length, see [`G3Store::stat`]); the payload lands at offset 4096.
    /// The header, length, padding and payload checksum are verified as
    /// the chunks arrive, before `Hit` is returned. O_DIRECT when `dst` is
    /// 4096-aligned (and the filesystem allows it), buffered otherwise. A
    /// block that fails verification is quarantined and reads as
    /// `Miss(Corrupt)`; `dst` then holds unspecified bytes.
    pub fn read_into(
        &self,
        ns: &NamespaceId,
        key: &BlockKey,
        dst: &mut [u8],
    ) -> Result<Lookup<BlockHeader>> {
        let found = {
            let mem = self.mem.read().map_err(|_| lock_err("g3 index"))?;
            mem.get(ns, key).map(|(id, e)| (id, e.file_len()))
        };
        let Some((id, file_len)) = found else {
            self.counters.misses.fetch_add(1, Ordering::Relaxed);
            return Ok(Lookup::Miss(MissReason::Absent));
        };
        if (dst.len() as u64) < file_len {
            return Err(Error::InvalidInput {
                what: "read buffer",
                reason: format!("{} bytes, the block file is {file_len}", dst.len()),
            });
        }
        let dst = &mut dst[..file_len as usize];
        match self.read_verified(ns, key, dst)? {
            ReadOutcome::Ok(h) => {
                self.counters.hits.fetch_add(1, Ordering::Relaxed);
                if let Ok(mem) = self.mem.read() {
                    if let Some(e) = mem.map.get(&id) {
                        e.hits.fetch_add(1, Ordering::Relaxed);
                        e.last_access_s.store(now_s(), Ordering::Relaxed);
                    }
                }
                if let Ok(mut p) = self.policy.lock() {
                    p.on_access(id);
                }
                Ok(Lookup::Hit(h))
            }
            ReadOutcome::Vanished => {
                self.counters.misses.fetch_add(1, Ordering::Relaxed);
                // Evicted or deleted under us, or lost behind our back.
                if self.forget(ns, key, id)? {
                    tracing::warn!(%ns, %key, "g3: block file vanished; dropped from the index");
                    self.emit(G3Event::Removed {
                        ns: *ns,
                        key: *key,
                        reason: RemoveReason::Corrupt,
                    });
                }
                Ok(Lookup::Miss(MissReason::Absent))
            }
            ReadOutcome::Corrupt(why) => {
                self.counters.misses.fetch_add(1, Ordering::Relaxed);
                self.quarantine(ns, key, id, &why);
                Ok(Lookup::Miss(MissReason::Corrupt))
            }
        }
    }

    fn read_verified(
        &self,
        ns: &NamespaceId,
        key: &BlockKey,
        dst: &mut [u8],
    ) -> Result<ReadOutcome> {
        let path = self.block_file_path(ns, key);
        let file = match self.open_block(&path, self.direct_ok && is_aligned(dst.as_ptr())) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(ReadOutcome::Vanished),
            Err(e) => return Err(Error::io("opening", &path, e)),
        };
        let want = dst.len() as u64;
        let size = file
            .metadata()
            .map_err(|e| Error::io("stat", &path, e))?
            .len();
        if size != want {
            return Ok(ReadOutcome::Corrupt(format!(
                "file is {size} bytes, index says {want}"
            )));
        }
        let mut v = Verifier::new(ns, key, want);
        let got = self
            .engine
            .read_file(file.as_raw_fd(), dst, &mut |piece| v.feed(piece))
            .map_err(|e| Error::io("reading", &path, e))?;
        Ok(v.finish(got as u64))
    }

    fn open_block(&self, path: &Path, direct: bool) -> std::io::Result<File> {
        let mut o = OpenOptions::new();
        o.read(true);
        if direct {
            match o
                .clone()
                .custom_flags(libc::O_DIRECT | libc::O_CLOEXEC)
                .open(path)
            {
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {}
                r => return r,
            }
        }
        o.custom_flags(libc::O_CLOEXEC).open(path)
    }

    /// Drops a block from memory, policy and redb (not the file).
    fn forget(&self, ns: &NamespaceId, key: &BlockKey, id: u64) -> Result<bool> {
        let (_, check) = digest(ns, key);
        // Another name whose digest collides keeps its entry (read before
        // the lock: no I/O under it).
        if matches!(self.disk.get(id), Ok(Some(r)) if r.ns != *ns || r.key != *key) {
            return Ok(false);
        }
        let removed = {
            let mut mem = self.mem.write().map_err(|_| lock_err("g3 index"))?;
            if mem.map.get(&id).is_none_or(|e| e.check != check) {
                return Ok(false);
            }
            let e = mem.remove(ns, id);
            if let Ok(mut p) = self.policy.lock() {
                p.on_remove(id);
            }
            e.is_some()
        };
        self.disk.remove(&[id])?;
        Ok(removed)
    }

    /// Moves a block that failed verification to `quarantine/`, counts and
    /// logs it, and emits `Removed { Corrupt }`.
    fn quarantine(&self, ns: &NamespaceId, key: &BlockKey, id: u64, why: &str) {
        let path = self.block_file_path(ns, key);
        tracing::warn!(%ns, %key, reason = why, "g3: block failed verification; quarantined");
        self.quarantine_file(&path, &format!("{}.{}", ns.to_hex(), key.to_hex()));
        if matches!(self.forget(ns, key, id), Ok(true)) {
            self.emit(G3Event::Removed {
                ns: *ns,
                key: *key,
                reason: RemoveReason::Corrupt,
            });
        }
    }

    fn quarantine_file(&self, path: &Path, name: &str) {
        self.counters.quarantined.fetch_add(1, Ordering::Relaxed);
        let to = self.quarantine_dir.join(format!("{name}.{}", now_ms()));
        if std::fs::rename(path, &to).is_err() {
            let _ = std::fs::remove_file(path);
        }
    }

    /// Opens the block's file for someone else to read (fd passing, FUSE
    /// passthrough, peers). Not verified here: the reader verifies with
    /// the header. An open file keeps reading after eviction unlinks it.
    pub fn open_for_read(
        &self,
        ns: &NamespaceId,
        key: &BlockKey,
    ) -> Result<Lookup<(File, BlockInfo)>> {
        let Some(info) = self.stat(ns, key) else {
            return Ok(Lookup::Miss(MissReason::Absent));
        };
        let path = self.block_file_path(ns, key);
        match OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_CLOEXEC)
            .open(&path)
        {
            Ok(f) => Ok(Lookup::Hit((f, info))),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                Ok(Lookup::Miss(MissReason::Absent))
            }
            Err(e) => Err(Error::io("opening", &path, e)),
        }
    }

    /// How many leading blocks of `chain` are present. Memory only: no disk
    /// access, no verification (a later read may still miss).
    pub fn lookup_prefix(&self, ns: &NamespaceId, chain: &[BlockKey]) -> usize {
        // One read lock per chain; hashing under it costs readers nothing
        // and delays a writer by at most the chain's hashing.
        self.mem
            .read()
            .map(|m| m.lookup_prefix(ns, chain))
            .unwrap_or(0)
    }

    /// [`G3Store::lookup_prefix`] over digests computed earlier with
    /// [`G3Store::chain_digests`] (a caller probing the same chain on
    /// several tiers or repeatedly hashes it once). Probes only.
    pub fn lookup_prefix_digests(&self, digests: &[(u64, u64)]) -> usize {
        self.mem
            .read()
            .map(|m| m.count_present(digests))
            .unwrap_or(0)
    }

    /// The index digests of a chain's keys, for
    /// [`G3Store::lookup_prefix_digests`].
    pub fn chain_digests(ns: &NamespaceId, chain: &[BlockKey]) -> Vec<(u64, u64)> {
        index::digests(ns, chain)
    }

    /// A block's state, or `None` when absent. Reads one redb record.
    pub fn stat(&self, ns: &NamespaceId, key: &BlockKey) -> Option<BlockInfo> {
        let (id, pinned, leases, priority, flags, hits, last) = {
            let mem = self.mem.read().ok()?;
            let (id, e) = mem.get(ns, key)?;
            (
                id,
                e.pinned(now_s()),
                e.leases,
                e.priority,
                e.flags,
                e.hits.load(Ordering::Relaxed),
                e.last_access_s.load(Ordering::Relaxed),
            )
        };
        let rec = self.disk.get_named(id, ns, key).ok()??;
        Some(BlockInfo {
            file_len: rec.file_len(),
            payload_len: rec.payload_len,
            payload_blake3: rec.payload_blake3,
            created_unix_ms: rec.created_unix_ms,
            hits,
            last_access_unix_ms: u64::from(last) * 1000,
            pinned,
            priority,
            ephemeral: flags & FLAG_EPHEMERAL != 0,
            leases,
            in_g4: flags & FLAG_IN_G4 != 0,
        })
    }

    /// Protects a present block from eviction for `ttl_ms` (cut to
    /// `lease_ttl_max_ms`). `Ok(None)` when absent; [`Error::LimitReached`]
    /// at `leases_max` live leases. Expired leases stop protecting.
    pub fn lease(&self, ns: &NamespaceId, key: &BlockKey, ttl_ms: u64) -> Result<Option<LeaseId>> {
        self.sweep_leases();
        let mut leases = self.leases.lock().map_err(|_| lock_err("g3 leases"))?;
        if leases.live.len() >= self.cfg.leases_max {
            return Err(Error::LimitReached {
                what: "g3 leases_max",
                limit: self.cfg.leases_max as u64,
            });
        }
        let mut mem = self.mem.write().map_err(|_| lock_err("g3 index"))?;
        let (id, check) = digest(ns, key);
        let Some(e) = mem.map.get_mut(&id).filter(|e| e.check == check) else {
            return Ok(None);
        };
        if e.leases == u16::MAX {
            return Err(Error::LimitReached {
                what: "g3 leases per block",
                limit: u64::from(u16::MAX),
            });
        }
        e.leases += 1;
        let lid = self.counters.seq.fetch_add(1, Ordering::Relaxed);
        let ttl = Duration::from_millis(ttl_ms.min(self.cfg.lease_ttl_max_ms));
        leases.live.insert(lid, (id, Instant::now() + ttl));
        Ok(Some(LeaseId(lid)))
    }

    /// Ends a lease; `false` when unknown or already expired.
    pub fn release(&self, lease: LeaseId) -> bool {
        let Ok(mut leases) = self.leases.lock() else {
            return false;
        };
        let Some((id, _)) = leases.live.remove(&lease.0) else {
            return false;
        };
        if let Ok(mut mem) = self.mem.write() {
            if let Some(e) = mem.map.get_mut(&id) {
                e.leases = e.leases.saturating_sub(1);
            }
        }
        true
    }

    /// Drops expired leases (they no longer protect their blocks).
    pub(crate) fn sweep_leases(&self) {
        let now = Instant::now();
        let Ok(mut leases) = self.leases.lock() else {
            return;
        };
        let expired: Vec<u64> = leases
            .live
            .iter()
            .filter(|(_, (_, t))| *t <= now)
            .map(|(l, _)| *l)
            .collect();
        if expired.is_empty() {
            return;
        }
        if let Ok(mut mem) = self.mem.write() {
            for l in expired {
                if let Some((id, _)) = leases.live.remove(&l) {
                    if let Some(e) = mem.map.get_mut(&id) {
                        e.leases = e.leases.saturating_sub(1);
                    }
                }
            }
        }
    }

    /// Pins a present block (never evicted) for `ttl_ms`, or until unpinned
    /// when `None`. `false` when absent or when `pinned_budget_bytes` would
    /// be exceeded.
    pub fn pin(&self, ns: &NamespaceId, key: &BlockKey, ttl_ms: Option<u64>) -> bool {
        let now = now_s();
        let Ok(mut mem) = self.mem.write() else {
            return false;
        };
        let Some((id, e)) = mem.get(ns, key) else {
            return false;
        };
        let (len, already) = (e.file_len(), e.pinned(now));
        if !already && mem.pinned_bytes(now) + len > self.cfg.pinned_budget_bytes {
            return false;
        }
        let until = match ttl_ms {
            None => PIN_FOREVER,
            Some(ms) => now
                .saturating_add((ms.div_ceil(1000)).min(u64::from(u32::MAX - 1)) as u32)
                .min(PIN_FOREVER - 1),
        };
        if let Some(e) = mem.map.get_mut(&id) {
            e.pin_until_s = until;
        }
        drop(mem);
        self.update_record(id, |r| r.pin_until_s = until);
        true
    }

    /// Removes a pin; `false` when absent or not pinned.
    pub fn unpin(&self, ns: &NamespaceId, key: &BlockKey) -> bool {
        let Ok(mut mem) = self.mem.write() else {
            return false;
        };
        let (id, check) = digest(ns, key);
        let Some(e) = mem.map.get_mut(&id).filter(|e| e.check == check) else {
            return false;
        };
        let was = e.pinned(now_s());
        e.pin_until_s = 0;
        drop(mem);
        self.update_record(id, |r| r.pin_until_s = 0);
        was
    }

    /// Sets the priority hint (told to the policy); `false` when absent.
    pub fn set_priority(&self, ns: &NamespaceId, key: &BlockKey, p: u8) -> bool {
        let hints = {
            let Ok(mut mem) = self.mem.write() else {
                return false;
            };
            let (id, check) = digest(ns, key);
            let Some(e) = mem.map.get_mut(&id).filter(|e| e.check == check) else {
                return false;
            };
            e.priority = p;
            (
                id,
                Hints {
                    priority: p,
                    pinned: e.pinned(now_s()),
                    ephemeral: e.flags & FLAG_EPHEMERAL != 0,
                    expected_reuse: 0,
                },
            )
        };
        if let Ok(mut pol) = self.policy.lock() {
            pol.on_hints(hints.0, hints.1);
        }
        self.update_record(hints.0, |r| r.priority = p);
        true
    }

    /// Records that a copy exists in G4. False only when it was recorded
    /// already (a block no longer here changes nothing, and returns true).
    pub fn mark_in_g4(&self, ns: &NamespaceId, key: &BlockKey) -> bool {
        let id = {
            let Ok(mut mem) = self.mem.write() else {
                return true;
            };
            let (id, check) = digest(ns, key);
            let Some(e) = mem.map.get_mut(&id).filter(|e| e.check == check) else {
                return true;
            };
            if e.flags & FLAG_IN_G4 != 0 {
                return false;
            }
            e.flags |= FLAG_IN_G4;
            id
        };
        self.update_record(id, |r| r.flags |= FLAG_IN_G4);
        true
    }

    fn update_record(&self, id: u64, f: impl FnOnce(&mut Record)) {
        if let Ok(Some(mut r)) = self.disk.get(id) {
            f(&mut r);
            if let Err(e) = self.disk.put(&[(id, &r)]) {
                tracing::warn!(error = %e, "g3: index update failed");
            }
        }
    }

    /// Up to `limit` keys of `ns` after `after`, sorted by raw key bytes
    /// (page by passing the last key back).
    pub fn list(&self, ns: &NamespaceId, after: Option<&BlockKey>, limit: usize) -> Vec<BlockKey> {
        self.disk.list(ns, after, limit).unwrap_or_else(|e| {
            tracing::warn!(error = %e, "g3: list failed");
            Vec::new()
        })
    }

    /// Namespaces that hold at least one block, sorted.
    pub fn namespaces(&self) -> Vec<NamespaceId> {
        let mut v: Vec<NamespaceId> = self
            .mem
            .read()
            .map(|m| m.ns_blocks.keys().copied().collect())
            .unwrap_or_default();
        v.sort();
        v
    }

    /// Counters and state.
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
            write_errors: c.write_errors.load(Ordering::Relaxed),
            engine: self.engine.name(),
            direct_io: self.direct_ok,
            read_only: self.poisoned.lock().ok().and_then(|p| p.clone()),
        }
    }

    /// Sets the receiver of [`G3Event`]s (replacing any earlier one).
    pub fn set_event_sink(&self, sink: EventSink) {
        if let Ok(mut s) = self.sink.write() {
            *s = Some(sink);
        }
    }

    /// Deletes a block (leases and pins do not protect against this);
    /// `false` when absent.
    pub fn delete_block(&self, ns: &NamespaceId, key: &BlockKey) -> Result<bool> {
        self.remove_block(ns, key, RemoveReason::Deleted)
    }

    fn remove_block(&self, ns: &NamespaceId, key: &BlockKey, reason: RemoveReason) -> Result<bool> {
        let (id, check) = digest(ns, key);
        let present = self
            .mem
            .read()
            .map_err(|_| lock_err("g3 index"))?
            .map
            .get(&id)
            .is_some_and(|e| e.check == check);
        if !present {
            return Ok(false);
        }
        let path = self.block_file_path(ns, key);
        match std::fs::remove_file(&path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(Error::io("removing", &path, e)),
        }
        if self.forget(ns, key, id)? {
            self.emit(G3Event::Removed {
                ns: *ns,
                key: *key,
                reason,
            });
            return Ok(true);
        }
        Ok(false)
    }

    /// Re-reads and re-checksums every block; failures are quarantined.
    pub fn verify_all(&self) -> Result<VerifyReport> {
        let mut names = Vec::new();
        self.disk
            .for_each(|_, r| names.push((r.ns, r.key, r.file_len())))?;
        let mut rep = VerifyReport::default();
        let mut buf = AlignedBuf::rounded(CHUNK_BYTES)
            .map_err(|e| Error::io("allocating", "verify buffer", e))?;
        for (ns, key, len) in names {
            if (buf.len() as u64) < len {
                buf = AlignedBuf::rounded(len as usize)
                    .map_err(|e| Error::io("allocating", "verify buffer", e))?;
            }
            rep.checked += 1;
            let q0 = self.counters.quarantined.load(Ordering::Relaxed);
            match self.read_into(&ns, &key, buf.as_mut_slice())? {
                Lookup::Hit(_) => rep.ok += 1,
                Lookup::Miss(MissReason::Corrupt) => rep.corrupt += 1,
                Lookup::Miss(_) => {
                    if self.counters.quarantined.load(Ordering::Relaxed) == q0 {
                        rep.vanished += 1;
                    }
                }
            }
        }
        Ok(rep)
    }

    /// Stops the reclaimer, writes hits and last access to the index, makes
    /// it durable and writes the clean-shutdown marker (the next open then
    /// loads the index without walking the files, see [`recover`]). Writes
    /// are refused afterwards; reads still work.
    pub fn close(&self) -> Result<()> {
        self.closed.store(true, Ordering::Release);
        // Waits for writes in flight (they passed the closed check).
        drop(
            self.write_gate
                .write()
                .map_err(|_| lock_err("g3 write gate"))?,
        );
        self.reclaim.stop();
        let handle = self.reclaimer.lock().ok().and_then(|mut h| h.take());
        if let Some(h) = handle {
            if h.thread().id() != std::thread::current().id() {
                let _ = h.join();
            }
        }
        let mut recs = Vec::new();
        let mut names = Vec::new();
        {
            let mem = self.mem.read().map_err(|_| lock_err("g3 index"))?;
            self.disk.for_each(|id, mut r| {
                if let Some(e) = mem.map.get(&id) {
                    index::merge_stats(&mut r, e);
                    names.push((r.ns, id));
                    recs.push((id, r));
                }
            })?;
        }
        for batch in recs.chunks(10_000) {
            let refs: Vec<(u64, &Record)> = batch.iter().map(|(i, r)| (*i, r)).collect();
            self.disk.put(&refs)?;
        }
        self.disk.flush()?;
        {
            // The in-memory image the next clean open loads instead of
            // iterating redb (snapshot.rs); made visible by the marker's
            // directory fsync below.
            let mem = self.mem.read().map_err(|_| lock_err("g3 index"))?;
            let generation = self.disk.generation()?;
            snapshot::write(&self.cfg.root, generation, &names, &mem)
                .map_err(|e| Error::io("writing index snapshot", &self.cfg.root, e))?;
        }
        // Only now is the index a complete, durable account of the files:
        // the next open may trust it instead of walking (recover.rs).
        self.write_clean_marker()
    }
}

impl Drop for G3Store {
    fn drop(&mut self) {
        self.reclaim.stop();
        if !self.closed.load(Ordering::Acquire) {
            let _ = self.disk.flush();
        }
    }
}

/// Whether files under `dir` can be opened with O_DIRECT (tmpfs and some
/// others refuse with EINVAL; then the store runs buffered).
fn probe_direct(dir: &Path) -> Result<bool> {
    let p = dir.join(format!(".direct-probe.{}", std::process::id()));
    let r = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .custom_flags(libc::O_DIRECT | libc::O_CLOEXEC)
        .open(&p);
    let _ = std::fs::remove_file(&p);
    match r {
        Ok(_) => Ok(true),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
            tracing::warn!(dir = %dir.display(), "g3: filesystem refuses O_DIRECT; using buffered I/O");
            Ok(false)
        }
        Err(e) => Err(Error::io("probing O_DIRECT in", dir, e)),
    }
}

/// rename(2) that refuses to replace an existing name (renameat2
/// RENAME_NOREPLACE), falling back to a link+unlink where unsupported.
fn rename_noreplace(from: &Path, to: &Path) -> std::io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let c = |p: &Path| {
        std::ffi::CString::new(p.as_os_str().as_bytes())
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))
    };
    let (f, t) = (c(from)?, c(to)?);
    // SAFETY: both are valid NUL-terminated paths.
    let r = unsafe {
        libc::renameat2(
            libc::AT_FDCWD,
            f.as_ptr(),
            libc::AT_FDCWD,
            t.as_ptr(),
            libc::RENAME_NOREPLACE,
        )
    };
    if r == 0 {
        return Ok(());
    }
    let e = std::io::Error::last_os_error();
    if e.raw_os_error() == Some(libc::EINVAL) {
        std::fs::hard_link(from, to)?;
        return std::fs::remove_file(from);
    }
    Err(e)
}

/// Checks a block file piece by piece as the engine completes it: header
/// first, then payload checksum and zero padding.
struct Verifier<'a> {
    ns: &'a NamespaceId,
    key: &'a BlockKey,
    file_len: u64,
    pos: u64,
    head: Vec<u8>,
    header: Option<BlockHeader>,
    hasher: blake3::Hasher,
    fault: Option<String>,
}

impl<'a> Verifier<'a> {
    fn new(ns: &'a NamespaceId, key: &'a BlockKey, file_len: u64) -> Self {
        Verifier {
            ns,
            key,
            file_len,
            pos: 0,
            head: Vec::new(),
            header: None,
            hasher: blake3::Hasher::new(),
            fault: None,
        }
    }

    fn feed(&mut self, piece: &[u8]) {
        let start = self.pos;
        self.pos += piece.len() as u64;
        if self.fault.is_some() {
            return;
        }
        let mut p = piece;
        let mut off = start;
        if self.header.is_none() {
            let need = HEADER_BYTES - self.head.len();
            let n = need.min(p.len());
            self.head.extend_from_slice(&p[..n]);
            p = &p[n..];
            off += n as u64;
            if self.head.len() < HEADER_BYTES {
                return;
            }
            match BlockHeader::decode(&self.head) {
                Ok(h) => {
                    if h.key != *self.key || h.namespace_id() != *self.ns {
                        self.fault = Some("header names another block".into());
                    } else if h.file_len() != self.file_len {
                        self.fault = Some(format!(
                            "header describes a {}-byte file, index says {}",
                            h.file_len(),
                            self.file_len
                        ));
                    }
                    self.header = Some(h);
                }
                Err(e) => self.fault = Some(e.to_string()),
            }
            if self.fault.is_some() {
                return;
            }
        }
        let Some(h) = &self.header else { return };
        let pend = HEADER_BYTES as u64 + h.payload_len;
        let end = off + p.len() as u64;
        let a = off.max(HEADER_BYTES as u64);
        let b = end.min(pend);
        if a < b {
            self.hasher
                .update(&p[(a - off) as usize..(b - off) as usize]);
        }
        let pad_from = off.max(pend);
        if pad_from < end && p[(pad_from - off) as usize..].iter().any(|&x| x != 0) {
            self.fault = Some("padding bytes are not zero".into());
        }
    }

    fn finish(self, got: u64) -> ReadOutcome {
        if let Some(f) = self.fault {
            return ReadOutcome::Corrupt(f);
        }
        if got != self.file_len || self.pos != self.file_len {
            return ReadOutcome::Corrupt(format!("read {got} bytes of {}", self.file_len));
        }
        match self.header {
            Some(h) if self.hasher.finalize().as_bytes() == &h.payload_blake3 => ReadOutcome::Ok(h),
            Some(_) => ReadOutcome::Corrupt("payload checksum mismatch".into()),
            None => ReadOutcome::Corrupt("no header".into()),
        }
    }
}

impl BlockTier for G3Store {
    fn name(&self) -> &'static str {
        "g3"
    }

    fn put(&self, ns: &NamespaceId, header: &BlockHeader, payload: &[u8]) -> Result<PutOutcome> {
        self.put_block(ns, header, payload, PutMeta::default())
    }

    fn get(&self, ns: &NamespaceId, key: &BlockKey) -> Result<Lookup<Block>> {
        let len = {
            let mem = self.mem.read().map_err(|_| lock_err("g3 index"))?;
            mem.get(ns, key).map(|(_, e)| e.file_len())
        };
        let Some(len) = len else {
            self.counters.misses.fetch_add(1, Ordering::Relaxed);
            return Ok(Lookup::Miss(MissReason::Absent));
        };
        let mut buf = AlignedBuf::rounded(len as usize)
            .map_err(|e| Error::io("allocating", "read buffer", e))?;
        Ok(match self.read_into(ns, key, buf.as_mut_slice())? {
            Lookup::Hit(header) => {
                let end = HEADER_BYTES + header.payload_len as usize;
                let payload = buf.as_slice()[HEADER_BYTES..end].to_vec();
                Lookup::Hit(Block { header, payload })
            }
            Lookup::Miss(r) => Lookup::Miss(r),
        })
    }

    fn contains(&self, ns: &NamespaceId, key: &BlockKey) -> Result<bool> {
        Ok(self
            .mem
            .read()
            .map_err(|_| lock_err("g3 index"))?
            .get(ns, key)
            .is_some())
    }

    fn delete(&self, ns: &NamespaceId, key: &BlockKey) -> Result<bool> {
        self.delete_block(ns, key)
    }
}
