//! The index: redb for what must survive a restart, an in-memory map for
//! what hot lookups need.
//!
//! Architecture invariant: the block files are the truth, the index is a
//! cache of them. redb commits on the write path are non-durable (the file
//! and its directory entry are already durable, and recovery adopts any
//! file the index lost); a durable commit runs every second and at close.
//!
//! In memory a block is 8 bytes of map key plus a 32-byte [`Entry`], found
//! by a 16-byte xxh3 digest of (namespace, key): the first 8 bytes are the
//! map key, the policy's id and redb's `blocks` key, the other 8 are
//! checked on every lookup. The full key, checksum and timestamps stay in
//! redb.

use crate::base::error::{Error, Result};
use kvtier_client::{BlockKey, NamespaceId};
use redb::{
    Database, Durability, ReadableDatabase, ReadableTable, ReadableTableMetadata, TableDefinition,
};
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};

const BLOCKS: TableDefinition<u64, &[u8]> = TableDefinition::new("blocks");
const NAMES: TableDefinition<&[u8], u64> = TableDefinition::new("names");
const META: TableDefinition<&str, u64> = TableDefinition::new("meta");
const GENERATION: &str = "generation";
const FORMAT: &str = "format";

/// On-disk format of `index.redb` (META `format`). 1 (no key): ids were the
/// first half of blake3(name); 2: xxh3-128. An index without the key is
/// re-keyed at open ([`DiskIndex::open`]); a larger one is refused.
pub const INDEX_FORMAT: u64 = 2;

/// The (id, check) digest of a block's name: xxh3-128 of (namespace, key
/// length, key), split in two halves. Not collision resistant against a
/// chosen key (blake3 was, at 15-20x the cost per lookup): every path that
/// acts on a found entry by name confirms it against the redb record
/// (`G3Store::put_block`, `stat`, removals), and reads verify the file's
/// header, so a collision costs a typed error or a false "present" from
/// `lookup_prefix`, never a wrong block.
pub fn digest(ns: &NamespaceId, key: &BlockKey) -> (u64, u64) {
    #[cfg(test)]
    if let Some(aliased) = test_alias::digest_of(ns, key) {
        return aliased;
    }
    // One-shot hashing of a stack buffer: the incremental Hasher costs
    // more than these 17..81 bytes need.
    let mut buf = [0u8; 16 + 1 + kvtier_client::key::KEY_BYTES_MAX];
    buf[..16].copy_from_slice(&ns.0);
    buf[16] = key.len() as u8;
    buf[17..17 + key.len()].copy_from_slice(key.as_bytes());
    let d = xxhash_rust::xxh3::xxh3_128(&buf[..17 + key.len()]);
    (d as u64, (d >> 64) as u64)
}

/// Test hook: makes one key digest as another on the calling thread, to
/// force an index collision.
#[cfg(test)]
pub mod test_alias {
    use kvtier_client::{BlockKey, NamespaceId};
    use std::cell::RefCell;

    thread_local! {
        static ALIAS: RefCell<Option<(BlockKey, BlockKey)>> = const { RefCell::new(None) };
    }

    /// From now on (this thread), `from` digests as `to`; `None` clears.
    pub fn set(alias: Option<(BlockKey, BlockKey)>) {
        ALIAS.with(|a| *a.borrow_mut() = alias);
    }

    pub(super) fn digest_of(ns: &NamespaceId, key: &BlockKey) -> Option<(u64, u64)> {
        let to = ALIAS.with(|a| match *a.borrow() {
            Some((from, to)) if from == *key => Some(to),
            _ => None,
        })?;
        let saved = ALIAS.with(|a| a.borrow_mut().take());
        let d = super::digest(ns, &to);
        ALIAS.with(|a| *a.borrow_mut() = saved);
        Some(d)
    }
}

/// [`digest`] of every key of a chain.
pub fn digests(ns: &NamespaceId, chain: &[BlockKey]) -> Vec<(u64, u64)> {
    chain.iter().map(|k| digest(ns, k)).collect()
}

/// Hashes a u64 id by the keyed mix (presence.rs): ids are uniform digests,
/// but of names a client chooses.
#[derive(Default, Clone, Copy)]
pub struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }
    fn write_u64(&mut self, v: u64) {
        // Keyed (presence.rs `mix`): ids are unkeyed digests of names a
        // client chooses, so their low bits could be aimed at one bucket.
        self.0 = super::presence::mix(v);
    }
}

/// Entry flag: evict first, never write below G3.
pub const FLAG_EPHEMERAL: u8 = 1;
/// Entry flag: a copy exists in G4.
pub const FLAG_IN_G4: u8 = 2;
/// Entry flag (recovery only): a file backs this entry.
pub const FLAG_SEEN: u8 = 4;

/// `pin_until_s` for a pin without expiry.
pub const PIN_FOREVER: u32 = u32::MAX;

/// What memory holds per block.
#[derive(Debug)]
pub struct Entry {
    /// Second half of the name digest.
    pub check: u64,
    /// File length / 4096.
    pub file_pages: u32,
    /// Reads served.
    pub hits: AtomicU32,
    /// Last read or write, Unix seconds.
    pub last_access_s: AtomicU32,
    /// Pinned until (Unix seconds); 0 = not pinned, [`PIN_FOREVER`].
    pub pin_until_s: u32,
    /// Live leases.
    pub leases: u16,
    /// Eviction priority hint.
    pub priority: u8,
    /// `FLAG_*` bits.
    pub flags: u8,
    /// The block's slot in the slab of its file length (slots.rs), or
    /// [`NO_SLOT`]: a file of its own under `blocks/`. Fills the padding
    /// the other fields leave (the entry stays 32 bytes).
    pub slot: u32,
}

/// [`Entry::slot`] of a block that has a file of its own.
pub const NO_SLOT: u32 = u32::MAX;

impl Entry {
    /// The block's slot, if it lives in one.
    pub fn slotted(&self) -> Option<u32> {
        (self.slot != NO_SLOT).then_some(self.slot)
    }
    /// File length in bytes.
    pub fn file_len(&self) -> u64 {
        u64::from(self.file_pages) * 4096
    }
    /// Whether a pin protects the block at `now_s`.
    pub fn pinned(&self, now_s: u32) -> bool {
        self.pin_until_s == PIN_FOREVER || self.pin_until_s > now_s
    }
}

/// The in-memory side of the index.
#[derive(Debug, Default)]
pub struct MemIndex {
    /// id -> entry.
    pub map: HashMap<u64, Entry, BuildHasherDefault<IdHasher>>,
    /// Sum of file lengths.
    pub used_bytes: u64,
    /// Blocks per namespace.
    pub ns_blocks: HashMap<NamespaceId, u64>,
    /// The checks of `map`'s entries, for `lookup_prefix` (kept in step by
    /// `insert` and the removals; do not insert into or remove from `map`
    /// directly).
    pub presence: super::presence::Presence,
    /// Parent links between held blocks (chains.rs); a removal drops the
    /// removed block's own link.
    pub chains: super::chains::Chains,
}

impl MemIndex {
    /// The entry for a name, if present.
    pub fn get(&self, ns: &NamespaceId, key: &BlockKey) -> Option<(u64, &Entry)> {
        let (id, check) = digest(ns, key);
        self.map
            .get(&id)
            .filter(|e| e.check == check)
            .map(|e| (id, e))
    }

    /// How many leading keys of `chain` are present. Memory only, no
    /// allocation: digests are computed into a stack buffer a batch at a
    /// time, then the batch is probed in [`MemIndex::presence`] (whose
    /// cache misses overlap).
    pub fn lookup_prefix(&self, ns: &NamespaceId, chain: &[BlockKey]) -> usize {
        const BATCH: usize = 64;
        let mut ids = [(0u64, 0u64); BATCH];
        let mut found = 0;
        for part in chain.chunks(BATCH) {
            for (slot, key) in ids.iter_mut().zip(part) {
                *slot = digest(ns, key);
            }
            let n = self.count_present(&ids[..part.len()]);
            found += n;
            if n < part.len() {
                break;
            }
        }
        found
    }

    /// How many leading digests (from [`digests`]) are present, by their
    /// checks (see [`super::presence`] for what that costs in accuracy).
    pub fn count_present(&self, ids: &[(u64, u64)]) -> usize {
        self.presence.count_leading(ids.iter().map(|d| d.1))
    }

    /// Entries pinned at `now_s` (pins are rare: a scan).
    pub fn pinned_blocks(&self, now_s: u32) -> u64 {
        self.map.values().filter(|e| e.pinned(now_s)).count() as u64
    }

    /// Bytes of the entries pinned at `now_s`.
    pub fn pinned_bytes(&self, now_s: u32) -> u64 {
        self.map
            .values()
            .filter(|e| e.pinned(now_s))
            .map(Entry::file_len)
            .sum()
    }

    /// Adds an entry and its bytes.
    pub fn insert(&mut self, ns: NamespaceId, id: u64, e: Entry) {
        self.used_bytes += e.file_len();
        *self.ns_blocks.entry(ns).or_default() += 1;
        self.presence.insert(e.check);
        if let Some(old) = self.map.insert(id, e) {
            self.presence.remove(old.check);
        }
    }

    /// Makes room for `n` more entries.
    pub fn reserve(&mut self, n: usize) {
        self.map.reserve(n);
        self.presence.reserve(self.map.len() + n);
    }

    /// Removes an entry whose namespace is unknown (its count per
    /// namespace is left as is).
    pub fn remove_id(&mut self, id: u64) -> Option<Entry> {
        let e = self.map.remove(&id)?;
        self.used_bytes = self.used_bytes.saturating_sub(e.file_len());
        self.presence.remove(e.check);
        self.chains.unlink(id);
        Some(e)
    }

    /// Removes an entry and its bytes.
    pub fn remove(&mut self, ns: &NamespaceId, id: u64) -> Option<Entry> {
        let e = self.map.remove(&id)?;
        self.used_bytes = self.used_bytes.saturating_sub(e.file_len());
        self.presence.remove(e.check);
        self.chains.unlink(id);
        if let Some(n) = self.ns_blocks.get_mut(ns) {
            *n -= 1;
            if *n == 0 {
                self.ns_blocks.remove(ns);
            }
        }
        Some(e)
    }
}

/// A block's persistent record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    /// Namespace.
    pub ns: NamespaceId,
    /// Key.
    pub key: BlockKey,
    /// Payload length.
    pub payload_len: u64,
    /// Payload checksum.
    pub payload_sum: kvtier_client::PayloadSum,
    /// When first stored.
    pub created_unix_ms: u64,
    /// Reads served (flushed at close).
    pub hits: u32,
    /// Last access, Unix seconds (flushed at close).
    pub last_access_s: u32,
    /// Pinned until (Unix seconds), see [`Entry::pin_until_s`].
    pub pin_until_s: u32,
    /// Priority hint.
    pub priority: u8,
    /// `FLAG_EPHEMERAL | FLAG_IN_G4`.
    pub flags: u8,
    /// The id of the block it continues (its chain parent, held when it
    /// was stored), so a restart keeps the leaves-first order. Encoded
    /// after the key (a flag byte and 8 bytes): records without it read
    /// as `None`, and builds before it ignore it.
    pub parent: Option<u64>,
    /// The block's slot in the slab of its file length (slots.rs); `None`:
    /// a file of its own. Encoded after the parent (tag 2 and 4 bytes):
    /// builds before slots read the parent and stop (docs/FORMAT.md).
    pub slot: Option<u32>,
}

const REC_FIXED: usize = 16 + 8 + 32 + 8 + 4 + 4 + 4 + 1 + 1 + 1;

impl Record {
    fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(REC_FIXED + self.key.len());
        v.extend_from_slice(&self.ns.0);
        v.extend_from_slice(&self.payload_len.to_le_bytes());
        v.extend_from_slice(self.payload_sum.as_bytes());
        v.extend_from_slice(&self.created_unix_ms.to_le_bytes());
        v.extend_from_slice(&self.hits.to_le_bytes());
        v.extend_from_slice(&self.last_access_s.to_le_bytes());
        v.extend_from_slice(&self.pin_until_s.to_le_bytes());
        v.push(self.priority);
        v.push(self.flags);
        v.push(self.key.len() as u8);
        v.extend_from_slice(self.key.as_bytes());
        if let Some(p) = self.parent {
            v.push(1);
            v.extend_from_slice(&p.to_le_bytes());
        }
        if let Some(slot) = self.slot {
            v.push(2);
            v.extend_from_slice(&slot.to_le_bytes());
        }
        v
    }

    fn decode(b: &[u8]) -> Option<Self> {
        if b.len() < REC_FIXED {
            return None;
        }
        let u64_at = |o: usize| {
            let mut a = [0u8; 8];
            a.copy_from_slice(&b[o..o + 8]);
            u64::from_le_bytes(a)
        };
        let u32_at = |o: usize| {
            let mut a = [0u8; 4];
            a.copy_from_slice(&b[o..o + 4]);
            u32::from_le_bytes(a)
        };
        let mut ns = [0u8; 16];
        ns.copy_from_slice(&b[..16]);
        let mut sum = [0u8; 32];
        sum.copy_from_slice(&b[24..56]);
        let klen = b[REC_FIXED - 1] as usize;
        let key = BlockKey::from_bytes(b.get(REC_FIXED..REC_FIXED + klen)?).ok()?;
        // Tagged optional fields: 1 the parent (8 bytes), 2 the slot (4).
        let mut at = REC_FIXED + klen;
        let (mut parent, mut slot) = (None, None);
        loop {
            match b.get(at) {
                Some(1) if b.len() >= at + 9 => {
                    parent = Some(u64_at(at + 1));
                    at += 9;
                }
                Some(2) if b.len() >= at + 5 => {
                    slot = Some(u32_at(at + 1));
                    at += 5;
                }
                _ => break,
            }
        }
        Some(Record {
            ns: NamespaceId(ns),
            key,
            payload_len: u64_at(16),
            payload_sum: kvtier_client::PayloadSum::from_bytes(sum),
            created_unix_ms: u64_at(56),
            hits: u32_at(64),
            last_access_s: u32_at(68),
            pin_until_s: u32_at(72),
            priority: b[76],
            flags: b[77],
            parent,
            slot,
        })
    }

    /// The file length this record describes.
    pub fn file_len(&self) -> u64 {
        kvtier_client::block::HEADER_BYTES as u64
            + kvtier_client::block::padded_len(self.payload_len)
    }
}

fn name_key(ns: &NamespaceId, key: &BlockKey) -> Vec<u8> {
    let mut v = Vec::with_capacity(16 + key.len());
    v.extend_from_slice(&ns.0);
    v.extend_from_slice(key.as_bytes());
    v
}

/// The persistent side of the index (one redb file).
///
/// After an I/O error redb fails every later operation ("Previous I/O error
/// occurred") until the database is opened again, and a full disk is the
/// usual cause: the failed write frees [`IndexReserve`]'s space, the
/// database is opened again, what was committed non-durably since the last
/// durable commit (lost by the reopen) is written again from
/// `since_durable`, and the write is tried once more. A write that still
/// fails is answered [`Error::NoSpace`] on ENOSPC, and the next operation
/// tries again (at most once a second).
pub struct DiskIndex {
    /// `None` while a reopen failed.
    db: std::sync::RwLock<Option<Database>>,
    path: PathBuf,
    dirty: std::sync::atomic::AtomicBool,
    /// Test seam: this many next `put` commits fail (see
    /// `G3Store::fault_fail_index_commits`).
    pub(super) fail_puts: std::sync::atomic::AtomicU64,
    /// Every record put (`Some`) or removed (`None`) by a commit not yet
    /// followed by a durable one; its lock orders the writes.
    since_durable: std::sync::Mutex<HashMap<u64, Option<Record>>>,
    /// Why the database must be opened again (an I/O error), and when it
    /// was last tried.
    /// Whether the cause was a full filesystem.
    broken: std::sync::Mutex<Option<(String, Option<std::time::Instant>, bool)>>,
    /// The seam the database was opened through, to open it again.
    fs: std::sync::RwLock<Option<std::sync::Arc<dyn super::seam::G3Fs>>>,
    /// Space held for the index (`index.reserve`).
    pub(super) reserve: IndexReserve,
    /// Reopens after an I/O error (`kvtier_g3_index_reopens_total`).
    pub(super) reopens: std::sync::atomic::AtomicU64,
}

/// Reopens tried at most this often while they fail.
const REOPEN_EVERY: std::time::Duration = std::time::Duration::from_secs(1);
/// A durable commit is forced past this many records committed
/// non-durably (the reclaimer makes one every second anyway).
const SINCE_DURABLE_MAX: usize = 1 << 16;

/// A file of `index.reserve` beside the index, holding filesystem space
/// that only the index uses: when a write of the index meets a full disk,
/// the file is removed, the index opened again and written into the space
/// it held; it is made again once the filesystem has room for it twice
/// (the reclaimer, every second). At open a filesystem with less free
/// space than that removes it first, so that a node starts on a full disk.
pub struct IndexReserve {
    path: PathBuf,
    bytes: u64,
    /// Whether the file holds its space now.
    held: std::sync::atomic::AtomicBool,
}

impl IndexReserve {
    /// The reserve of the index in `root` for a store of `capacity_bytes`:
    /// 1/256 of it, between 1 and 16 MiB (about 10,000 to 160,000 index
    /// records).
    pub fn new(root: &Path, capacity_bytes: u64) -> Self {
        let bytes = (capacity_bytes / 256).clamp(1 << 20, 16 << 20);
        let held = std::fs::metadata(root.join(RESERVE_FILE)).is_ok_and(|m| m.len() >= bytes);
        IndexReserve {
            path: root.join(RESERVE_FILE),
            bytes,
            held: std::sync::atomic::AtomicBool::new(held),
        }
    }

    /// Its size.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Whether it holds its space now (false: the filesystem was full).
    pub fn held(&self) -> bool {
        self.held.load(Ordering::Acquire)
    }

    /// Frees its space; whether there was any to free.
    pub fn release(&self) -> bool {
        let had = self.held.swap(false, Ordering::AcqRel);
        match std::fs::remove_file(&self.path) {
            Ok(()) => {
                tracing::warn!(reserve = %self.path.display(), bytes = self.bytes,
                    "g3: the filesystem is full; the index's reserve is released for the index");
                true
            }
            Err(_) => had,
        }
    }

    /// Bytes the filesystem of the reserve has free.
    fn free_bytes(&self) -> Option<u64> {
        let dir = self.path.parent()?;
        let st = nix::sys::statvfs::statvfs(dir).ok()?;
        Some(st.blocks_available() as u64 * st.fragment_size() as u64)
    }

    /// Whether the filesystem has less free than the reserve's size.
    pub fn short(&self) -> bool {
        self.free_bytes().is_some_and(|f| f < self.bytes)
    }

    /// At open: released when the filesystem has less than twice its size
    /// free (a full disk must not keep the index from opening).
    pub fn release_if_short(&self) {
        if self
            .free_bytes()
            .is_some_and(|f| f < self.bytes.saturating_mul(2))
        {
            self.release();
        }
    }

    /// Made (again) when missing and the filesystem has room for it twice
    /// over; whether it holds its space now.
    pub fn replenish(&self) -> bool {
        if self.held() {
            return true;
        }
        if self
            .free_bytes()
            .is_none_or(|f| f < self.bytes.saturating_mul(3))
        {
            return false;
        }
        let made = (|| -> std::io::Result<()> {
            use std::os::unix::fs::OpenOptionsExt;
            let f = std::fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(false)
                .mode(0o600)
                .open(&self.path)?;
            nix::fcntl::posix_fallocate(&f, 0, self.bytes as i64).map_err(std::io::Error::from)?;
            f.sync_all()
        })();
        match made {
            Ok(()) => {
                self.held.store(true, Ordering::Release);
                true
            }
            Err(e) => {
                let _ = std::fs::remove_file(&self.path);
                tracing::debug!(error = %e, "g3: the index's reserve cannot be made yet");
                false
            }
        }
    }
}

/// Name of the reserve file under the store's root.
pub const RESERVE_FILE: &str = "index.reserve";

impl DiskIndex {
    /// Opens or creates the index file (redb repairs after a crash).
    pub fn open(path: &Path) -> Result<Self> {
        Self::open_or_damaged(&super::seam::RealFs, path).map_err(|(_, e)| e)
    }

    /// Like [`DiskIndex::open`]; the flag of the error says whether redb
    /// could not open the file at all (a damaged or foreign file, which
    /// recovery rebuilds) rather than refused its contents (a newer
    /// format, which must not be destroyed by an older build).
    pub(super) fn open_or_damaged(
        fs: &dyn super::seam::G3Fs,
        path: &Path,
    ) -> std::result::Result<Self, (bool, Error)> {
        // redb panics (`unreachable!`) on some damaged files rather than
        // returning an error (found by the power-loss harness with its
        // sync removed): a panic while opening is a damaged index, which
        // is rebuilt from the files, never a daemon that cannot start.
        let opened = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            Self::open_or_damaged_inner(fs, path)
        }));
        opened.unwrap_or_else(|_| {
            Err((
                true,
                Error::Index {
                    path: path.to_path_buf(),
                    detail: "redb panicked reading the file (damaged)".into(),
                },
            ))
        })
    }

    fn open_or_damaged_inner(
        fs: &dyn super::seam::G3Fs,
        path: &Path,
    ) -> std::result::Result<Self, (bool, Error)> {
        let db = Self::open_database(fs, path)?;
        Self::init(db, path).map_err(|e| (false, e))
    }

    /// redb's open of the file, checked (see [`DiskIndex::open_or_damaged`]).
    fn open_database(
        fs: &dyn super::seam::G3Fs,
        path: &Path,
    ) -> std::result::Result<Database, (bool, Error)> {
        let fail = |e: &dyn std::fmt::Display| Error::Index {
            path: path.to_path_buf(),
            detail: e.to_string(),
        };
        let backend = fs.index_backend(path).map_err(|e| (false, fail(&e)))?;
        let mut db = match backend {
            None => Database::create(path),
            Some(b) => redb::Builder::new().create_with_backend(b),
        }
        .map_err(|e| {
            // Another handle holds the file (redb's own lock): that is an
            // index in use, never a damaged one to set aside and rebuild.
            let damaged = !matches!(e, redb::DatabaseError::DatabaseAlreadyOpen);
            (damaged, fail(&e))
        })?;
        // redb checks every page's checksum and its allocator state before
        // anything reads or writes: a file it opens but cannot walk or
        // extend is damaged, set aside and rebuilt from the files (the
        // power-loss mutation check without the index sync made redb panic
        // later, in a scan and in a commit). At every open, not only after
        // an unclean stop: a clean marker can outlive index pages a disk
        // never wrote (the same mutation check, a cut inside close). One
        // sequential read of the index file (about 100 bytes per block).
        match db.check_integrity() {
            Ok(true) => {}
            // Repaired: redb rolled back what it could not keep, so the
            // index may lack blocks whose files are whole; without the
            // clean marker this open walks the files and adopts them.
            Ok(false) => {
                tracing::warn!(index = %path.display(), "g3: redb repaired the index; the files are walked");
                if let Some(root) = path.parent() {
                    match fs.remove_file(
                        &root.join(super::recover::CLEAN_MARKER),
                        super::seam::Unlink::Housekeeping,
                    ) {
                        Ok(()) => {}
                        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                        Err(e) => return Err((false, fail(&e))),
                    }
                }
            }
            Err(e) => return Err((true, fail(&e))),
        }
        Ok(db)
    }
    fn init(db: Database, path: &Path) -> Result<Self> {
        let fail = |e: &dyn std::fmt::Display| Error::Index {
            path: path.to_path_buf(),
            detail: e.to_string(),
        };
        let root = path.parent().unwrap_or(Path::new("."));
        let me = DiskIndex {
            db: std::sync::RwLock::new(Some(db)),
            path: path.to_path_buf(),
            dirty: std::sync::atomic::AtomicBool::new(false),
            fail_puts: std::sync::atomic::AtomicU64::new(0),
            since_durable: std::sync::Mutex::new(HashMap::new()),
            broken: std::sync::Mutex::new(None),
            fs: std::sync::RwLock::new(None),
            reserve: IndexReserve::new(root, 0),
            reopens: std::sync::atomic::AtomicU64::new(0),
        };
        // Non-durable: tables lost to a crash are created again, and the
        // files are the truth anyway; an fsync here costs every open.
        let format = me.write(Durability::None, |w| {
            w.open_table(BLOCKS)?;
            w.open_table(NAMES)?;
            let mut meta = w.open_table(META)?;
            let format = meta.get(FORMAT)?.map(|g| g.value());
            if format.is_none() && w.open_table(BLOCKS)?.is_empty()? {
                meta.insert(FORMAT, INDEX_FORMAT)?;
                return Ok(Some(INDEX_FORMAT));
            }
            Ok(format)
        })?;
        match format {
            Some(INDEX_FORMAT) => {}
            None => me.rekey_from_format_1()?,
            Some(other) => {
                return Err(fail(&format!(
                    "index format {other} is newer than this build reads ({INDEX_FORMAT}); \
                     run the matching kvtierd, or move index.redb, index.snap and clean \
                     aside so the index is rebuilt from the block files"
                )))
            }
        }
        Ok(me)
    }

    /// Format 1 keyed records by a blake3-derived id: every record is moved
    /// to its xxh3 id (records carry the full name) in one durable commit,
    /// so a crash leaves either format whole. Two names whose new ids
    /// collide keep the first; the other's file is no longer indexed (it
    /// stays on disk, invisible, until deleted by hand).
    fn rekey_from_format_1(&self) -> Result<()> {
        let t = std::time::Instant::now();
        let mut recs = Vec::new();
        self.for_each(|_, r| recs.push(r))?;
        let n = recs.len();
        let mut dropped = 0u64;
        self.write(Durability::Immediate, |w| {
            w.delete_table(BLOCKS)?;
            w.delete_table(NAMES)?;
            let mut b = w.open_table(BLOCKS)?;
            let mut names = w.open_table(NAMES)?;
            for r in &recs {
                let (id, _) = digest(&r.ns, &r.key);
                if b.get(id)?.is_some() {
                    dropped += 1;
                    continue;
                }
                b.insert(id, r.encode().as_slice())?;
                names.insert(name_key(&r.ns, &r.key).as_slice(), id)?;
            }
            w.open_table(META)?.insert(FORMAT, INDEX_FORMAT)?;
            Ok(())
        })?;
        tracing::warn!(
            path = %self.path.display(),
            records = n,
            dropped_on_collision = dropped,
            elapsed_ms = t.elapsed().as_millis() as u64,
            "g3: index re-keyed from format 1 (blake3 ids) to {INDEX_FORMAT} (xxh3 ids)"
        );
        Ok(())
    }

    fn err(&self, e: impl std::fmt::Display) -> Error {
        Error::Index {
            path: self.path.clone(),
            detail: e.to_string(),
        }
    }

    /// The seam to open the file through again after an I/O error, and
    /// the reserve's size from the store's capacity.
    pub(super) fn attach(&mut self, fs: std::sync::Arc<dyn super::seam::G3Fs>, capacity: u64) {
        if let Ok(mut f) = self.fs.write() {
            *f = Some(fs);
        }
        let root = self.path.parent().unwrap_or(Path::new("."));
        self.reserve = IndexReserve::new(root, capacity);
    }

    /// A redb error as ours; an I/O error (redb fails every later
    /// operation after one) marks the database for a reopen, and ENOSPC
    /// becomes [`Error::NoSpace`].
    fn classify(&self, e: impl Into<redb::Error>) -> Error {
        match e.into() {
            redb::Error::Io(io) => {
                let full = matches!(io.raw_os_error(), Some(libc::ENOSPC | libc::EDQUOT));
                self.mark_broken(&io, full);
                Error::io("writing the index", &self.path, io)
            }
            redb::Error::PreviousIo => {
                self.mark_broken(&"an earlier I/O error", false);
                self.err(redb::Error::PreviousIo)
            }
            e => self.err(e),
        }
    }

    fn mark_broken(&self, cause: &dyn std::fmt::Display, full: bool) {
        if let Ok(mut b) = self.broken.lock() {
            if b.is_none() {
                tracing::error!(index = %self.path.display(), %cause,
                    "g3: I/O error on the index; it is opened again");
                *b = Some((cause.to_string(), None, full));
            }
        }
    }

    /// Whether an I/O error broke the database and no reopen mended it.
    pub fn broken(&self) -> bool {
        self.broken.lock().map(|b| b.is_some()).unwrap_or(true)
    }

    /// Opens the database again when an I/O error broke it (at most once
    /// every [`REOPEN_EVERY`] unless `now`) and writes again what
    /// `since_durable` holds. The caller holds `since_durable`.
    fn mend(&self, log: &HashMap<u64, Option<Record>>, now: bool) -> Result<()> {
        let cause = {
            let mut b = self
                .broken
                .lock()
                .map_err(|_| super::lock_err("g3 index"))?;
            let Some((cause, last, full)) = b.as_mut() else {
                return Ok(());
            };
            if !now && last.is_some_and(|t| t.elapsed() < REOPEN_EVERY) {
                if *full {
                    return Err(Error::NoSpace {
                        path: self.path.clone(),
                        op: "writing the index",
                    });
                }
                return Err(self.err(format!("the index is being opened again after: {cause}")));
            }
            *last = Some(std::time::Instant::now());
            cause.clone()
        };
        {
            let mut db = self.db.write().map_err(|_| super::lock_err("g3 index"))?;
            // The old handle goes first: it holds redb's lock on the file.
            *db = None;
            let fs = self.fs.read().ok().and_then(|f| f.clone());
            let opened = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| match &fs {
                Some(fs) => Self::open_database(fs.as_ref(), &self.path),
                None => Self::open_database(&super::seam::RealFs, &self.path),
            }))
            .unwrap_or_else(|_| Err((true, self.err("redb panicked reopening the file"))));
            *db = Some(opened.map_err(|(_, e)| e)?);
        }
        if let Ok(mut b) = self.broken.lock() {
            *b = None;
        }
        if !log.is_empty() {
            self.write(Durability::None, |w| {
                let mut b = w.open_table(BLOCKS)?;
                let mut n = w.open_table(NAMES)?;
                for (id, r) in log {
                    match r {
                        Some(r) => {
                            b.insert(*id, r.encode().as_slice())?;
                            n.insert(name_key(&r.ns, &r.key).as_slice(), *id)?;
                        }
                        None => {
                            if let Some(old) =
                                b.remove(*id)?.and_then(|g| Record::decode(g.value()))
                            {
                                n.remove(name_key(&old.ns, &old.key).as_slice())?;
                            }
                        }
                    }
                }
                Ok(())
            })?;
        }
        self.reopens.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(index = %self.path.display(), %cause, rewritten = log.len(),
            "g3: the index was opened again after an I/O error");
        Ok(())
    }

    /// A write that survives an I/O error: `f` runs on the open database
    /// (mended first when broken); when it fails with an I/O error, the
    /// reserve's space is freed on ENOSPC, the database mended and `f`
    /// tried once more. `note` records what the write changed in
    /// `since_durable` (a durable write empties it).
    fn logged_write<T>(
        &self,
        durability: Durability,
        f: impl Fn(&redb::WriteTransaction) -> std::result::Result<T, redb::Error>,
        note: impl Fn(&mut HashMap<u64, Option<Record>>),
        undone_on_failure: bool,
    ) -> Result<T> {
        let mut log = self
            .since_durable
            .lock()
            .map_err(|_| super::lock_err("g3 index"))?;
        let tried = self
            .mend(&log, false)
            .and_then(|()| match self.write(durability, &f) {
                Err(e) if self.broken() => {
                    if matches!(e, Error::NoSpace { .. }) && !self.reserve.release() {
                        return Err(e);
                    }
                    self.mend(&log, true)?;
                    self.write(durability, &f)
                }
                r => r,
            });
        let t = match tried {
            Ok(t) => t,
            Err(e) => {
                // A removal the caller keeps (the block is gone from
                // memory) is written by the next mend.
                if !undone_on_failure {
                    note(&mut log);
                }
                return Err(e);
            }
        };
        if matches!(durability, Durability::None) {
            note(&mut log);
            if log.len() > SINCE_DURABLE_MAX
                && self.write(Durability::Immediate, |_| Ok(())).is_ok()
            {
                log.clear();
            }
        } else {
            log.clear();
        }
        Ok(t)
    }

    /// Runs one redb operation; a panic inside redb (its `unreachable!` on
    /// some damaged pages, which open does not always meet: found by the
    /// power-loss mutation check, in close's scan) is an index error, never
    /// a daemon that dies. The next open checks the whole file
    /// (`check_integrity`) and sets a damaged one aside.
    fn guarded<T>(&self, f: impl FnOnce() -> Result<T>) -> Result<T> {
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(f))
            .unwrap_or_else(|_| Err(self.err("redb panicked reading the file (damaged)")))
    }

    /// Runs `f` on the open database (a read): mended first when broken.
    fn read<T>(&self, f: impl FnOnce(&Database) -> Result<T>) -> Result<T> {
        if self.broken() {
            let log = self
                .since_durable
                .lock()
                .map_err(|_| super::lock_err("g3 index"))?;
            self.mend(&log, false)?;
        }
        self.guarded(|| {
            let db = self.db.read().map_err(|_| super::lock_err("g3 index"))?;
            let db = db
                .as_ref()
                .ok_or_else(|| self.err("the index is being opened again"))?;
            f(db)
        })
    }

    fn write<T>(
        &self,
        durability: Durability,
        f: impl FnOnce(&redb::WriteTransaction) -> std::result::Result<T, redb::Error>,
    ) -> Result<T> {
        self.guarded(|| {
            let lazy = matches!(durability, Durability::None);
            let db = self.db.read().map_err(|_| super::lock_err("g3 index"))?;
            let db = db
                .as_ref()
                .ok_or_else(|| self.err("the index is being opened again"))?;
            let mut w = db.begin_write().map_err(|e| self.classify(e))?;
            w.set_durability(durability).map_err(|e| self.classify(e))?;
            if !lazy {
                // Durable commits also record redb's allocator state, so that
                // an open after a crash (or a drop that could not record it)
                // loads it instead of rebuilding it from the whole file.
                w.set_quick_repair(true);
            }
            let t = f(&w).map_err(|e| self.classify(e))?;
            w.commit().map_err(|e| self.classify(e))?;
            if lazy {
                self.dirty.store(true, Ordering::Release);
            }
            Ok(t)
        })
    }

    /// Inserts or replaces records (non-durable commit).
    pub fn put(&self, recs: &[(u64, &Record)]) -> Result<()> {
        use std::sync::atomic::Ordering;
        if self
            .fail_puts
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1))
            .is_ok()
        {
            return Err(self.err("injected commit failure (test fault seam)"));
        }
        self.logged_write(
            Durability::None,
            |w| {
                let mut b = w.open_table(BLOCKS)?;
                let mut n = w.open_table(NAMES)?;
                for (id, r) in recs {
                    b.insert(*id, r.encode().as_slice())?;
                    n.insert(name_key(&r.ns, &r.key).as_slice(), *id)?;
                }
                Ok(())
            },
            |log| {
                for (id, r) in recs {
                    log.insert(*id, Some((*r).clone()));
                }
            },
            true,
        )
    }

    /// Changes the record of `id` in place, when there is one (one
    /// non-durable transaction: a removal cannot come between the read
    /// and the write and have the record written back). Whether it was
    /// there.
    pub fn update(&self, id: u64, f: impl Fn(&mut Record)) -> Result<bool> {
        let changed: std::sync::Mutex<Option<Record>> = std::sync::Mutex::new(None);
        self.logged_write(
            Durability::None,
            |w| {
                let mut b = w.open_table(BLOCKS)?;
                let cur = b.get(id)?.and_then(|g| Record::decode(g.value()));
                let Some(mut r) = cur else {
                    return Ok(false);
                };
                f(&mut r);
                b.insert(id, r.encode().as_slice())?;
                if let Ok(mut c) = changed.lock() {
                    *c = Some(r);
                }
                Ok(true)
            },
            |log| {
                if let Some(r) = changed.lock().ok().and_then(|mut c| c.take()) {
                    log.insert(id, Some(r));
                }
            },
            true,
        )
    }

    /// Removes the record of `id` when `keep` says it is the one the
    /// caller removes (one non-durable transaction); whether it went.
    pub fn remove_if(&self, id: u64, which: impl Fn(&Record) -> bool) -> Result<bool> {
        let gone = std::sync::atomic::AtomicBool::new(false);
        self.logged_write(
            Durability::None,
            |w| {
                let mut b = w.open_table(BLOCKS)?;
                let cur = b.get(id)?.and_then(|g| Record::decode(g.value()));
                let Some(r) = cur.filter(|r| which(r)) else {
                    return Ok(false);
                };
                b.remove(id)?;
                let mut n = w.open_table(NAMES)?;
                n.remove(name_key(&r.ns, &r.key).as_slice())?;
                gone.store(true, std::sync::atomic::Ordering::Relaxed);
                Ok(true)
            },
            |log| {
                if gone.load(std::sync::atomic::Ordering::Relaxed) {
                    log.insert(id, None);
                }
            },
            false,
        )
    }

    /// Removes records (non-durable commit).
    pub fn remove(&self, ids: &[u64]) -> Result<()> {
        self.logged_write(
            Durability::None,
            |w| {
                let mut b = w.open_table(BLOCKS)?;
                let mut n = w.open_table(NAMES)?;
                for id in ids {
                    let old = b.remove(*id)?.and_then(|g| Record::decode(g.value()));
                    if let Some(r) = old {
                        n.remove(name_key(&r.ns, &r.key).as_slice())?;
                    }
                }
                Ok(())
            },
            |log| {
                for id in ids {
                    log.insert(*id, None);
                }
            },
            false,
        )
    }

    /// One record.
    pub fn get(&self, id: u64) -> Result<Option<Record>> {
        self.read(|db| {
            let r = db.begin_read().map_err(|e| self.classify(e))?;
            let t = r.open_table(BLOCKS).map_err(|e| self.err(e))?;
            let v = t.get(id).map_err(|e| self.err(e))?;
            Ok(v.and_then(|g| Record::decode(g.value())))
        })
    }

    /// The record of `id` when it names (`ns`, `key`): `None` for an absent
    /// record and for another name whose digest collides.
    pub fn get_named(&self, id: u64, ns: &NamespaceId, key: &BlockKey) -> Result<Option<Record>> {
        Ok(self.get(id)?.filter(|r| r.ns == *ns && r.key == *key))
    }

    /// Visits every record (recovery).
    pub fn for_each(&self, mut f: impl FnMut(u64, Record)) -> Result<()> {
        self.read(|db| {
            let r = db.begin_read().map_err(|e| self.classify(e))?;
            let t = r.open_table(BLOCKS).map_err(|e| self.err(e))?;
            for item in t.iter().map_err(|e| self.err(e))? {
                let (k, v) = item.map_err(|e| self.err(e))?;
                if let Some(rec) = Record::decode(v.value()) {
                    f(k.value(), rec);
                }
            }
            Ok(())
        })
    }

    /// Keys of `ns` after `after`, sorted by raw key bytes.
    pub fn list(
        &self,
        ns: &NamespaceId,
        after: Option<&BlockKey>,
        limit: usize,
    ) -> Result<Vec<BlockKey>> {
        self.read(|db| {
            let r = db.begin_read().map_err(|e| self.classify(e))?;
            let t = r.open_table(NAMES).map_err(|e| self.err(e))?;
            let start: Vec<u8> = match after {
                Some(k) => {
                    let mut v = name_key(ns, k);
                    v.push(0);
                    v
                }
                None => ns.0.to_vec(),
            };
            let mut out = Vec::new();
            for item in t.range(start.as_slice()..).map_err(|e| self.err(e))? {
                if out.len() >= limit {
                    break;
                }
                let (k, _) = item.map_err(|e| self.err(e))?;
                let k = k.value();
                if k.len() <= 16 || k[..16] != ns.0 {
                    break;
                }
                if let Ok(key) = BlockKey::from_bytes(&k[16..]) {
                    out.push(key);
                }
            }
            Ok(out)
        })
    }

    /// The index generation: bumped (durably) at every open, written into
    /// the clean-shutdown marker at close, so that a marker is trusted only
    /// beside the index it was written for.
    pub fn generation(&self) -> Result<u64> {
        self.read(|db| {
            let r = db.begin_read().map_err(|e| self.classify(e))?;
            let t = r.open_table(META).map_err(|e| self.err(e))?;
            let v = t.get(GENERATION).map_err(|e| self.err(e))?;
            Ok(v.map(|g| g.value()).unwrap_or(0))
        })
    }

    /// Sets the generation (non-durable commit: it is bumped only after
    /// the clean marker was durably removed, so losing the bump to a crash
    /// cannot make a stale marker valid; `close` makes it durable before
    /// writing the next marker).
    pub fn set_generation(&self, generation: u64) -> Result<()> {
        self.logged_write(
            Durability::None,
            |w| {
                w.open_table(META)?.insert(GENERATION, generation)?;
                Ok(())
            },
            |_| {},
            true,
        )
    }

    /// Makes every earlier non-durable commit durable.
    pub fn flush(&self) -> Result<()> {
        self.dirty.store(false, Ordering::Release);
        self.logged_write(Durability::Immediate, |_| Ok(()), |_| {}, true)
    }

    /// [`DiskIndex::flush`] when something changed since the last one (or
    /// an I/O error broke the database: it is mended here, off the write
    /// path).
    pub fn flush_if_dirty(&self) -> Result<()> {
        if self.dirty.swap(false, Ordering::AcqRel) || self.broken() {
            return self.flush();
        }
        Ok(())
    }
}

/// Hits and last access from memory into records (at close).
pub fn merge_stats(rec: &mut Record, e: &Entry) {
    rec.hits = e.hits.load(Ordering::Relaxed);
    rec.last_access_s = e.last_access_s.load(Ordering::Relaxed);
    rec.pin_until_s = e.pin_until_s;
    rec.priority = e.priority;
    rec.flags = e.flags & (FLAG_EPHEMERAL | FLAG_IN_G4);
}

/// Test helper: rewrites an index as a format-1 build left it (records
/// keyed by the first half of blake3(name), no `format` key).
#[cfg(test)]
pub fn write_format_1(path: &Path) -> std::result::Result<(), redb::Error> {
    let db = Database::create(path)?;
    let w = db.begin_write()?;
    {
        let mut recs = Vec::new();
        for item in w.open_table(BLOCKS)?.iter()? {
            let (_, v) = item?;
            recs.extend(Record::decode(v.value()));
        }
        w.delete_table(BLOCKS)?;
        w.delete_table(NAMES)?;
        let mut b = w.open_table(BLOCKS)?;
        let mut n = w.open_table(NAMES)?;
        for r in &recs {
            let mut buf = ns_key_bytes(&r.ns, &r.key);
            buf.insert(16, r.key.len() as u8);
            let d = blake3::hash(&buf);
            let mut id = [0u8; 8];
            id.copy_from_slice(&d.as_bytes()[..8]);
            let id = u64::from_le_bytes(id);
            b.insert(id, r.encode().as_slice())?;
            n.insert(name_key(&r.ns, &r.key).as_slice(), id)?;
        }
        w.open_table(META)?.remove(FORMAT)?;
    }
    w.commit()?;
    Ok(())
}

#[cfg(test)]
fn ns_key_bytes(ns: &NamespaceId, key: &BlockKey) -> Vec<u8> {
    name_key(ns, key)
}

/// Test helper: the `format` key of an index.
#[cfg(test)]
pub fn format_of(path: &Path) -> std::result::Result<Option<u64>, redb::Error> {
    let db = Database::create(path)?;
    let r = db.begin_read()?;
    let v = r.open_table(META)?.get(FORMAT)?.map(|g| g.value());
    Ok(v)
}

/// Test helper: sets the `format` key of an index.
#[cfg(test)]
pub fn set_format(path: &Path, format: u64) -> std::result::Result<(), redb::Error> {
    let db = Database::create(path)?;
    let w = db.begin_write()?;
    w.open_table(META)?.insert(FORMAT, format)?;
    w.commit()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn record_round_trip_and_entry_size() {
        let r = Record {
            ns: NamespaceId([7; 16]),
            key: BlockKey::from_u64(99),
            payload_len: 65536,
            payload_sum: kvtier_client::PayloadSum::from_bytes([3; 32]),
            created_unix_ms: 5,
            hits: 6,
            last_access_s: 7,
            pin_until_s: 8,
            priority: 9,
            flags: FLAG_IN_G4,
            parent: None,
            slot: None,
        };
        assert_eq!(Record::decode(&r.encode()), Some(r.clone()));
        let slotted = Record {
            parent: Some(0xbeef),
            slot: Some(41),
            ..r.clone()
        };
        assert_eq!(Record::decode(&slotted.encode()), Some(slotted.clone()));
        let linked = Record {
            parent: Some(0xfeed),
            ..r.clone()
        };
        assert_eq!(Record::decode(&linked.encode()), Some(linked.clone()));
        // What a build before the link reads: the record without it.
        let old = linked.encode();
        assert_eq!(old.len(), r.encode().len() + 9);
        assert_eq!(r.file_len(), 4096 + 65536);
        assert_eq!(std::mem::size_of::<Entry>(), 32);
    }
}
