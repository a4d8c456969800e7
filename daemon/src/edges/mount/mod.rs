//! The mount: G3 shown as a filesystem through `kvtier-fs`.
//!
//! [`G3Namespace`] implements [`kvtier_fs::KvNamespace`] over an
//! `Arc<G3Store>` (the daemon implements fs's trait; fs never imports the
//! daemon). [`start`] mounts it as `[mount]` says and returns a
//! [`MountHandle`] (unmounts on drop). Blocks that are not in G3 are
//! brought in by an optional [`FetchHook`] (G4, peers) before they are
//! shown. `/.kvtier/events` is fed from G3 events through
//! [`MountEvents::feed`]: G3 accepts one event sink, so whoever owns it
//! chains this call into theirs (or uses [`MountEvents::sink`]).
//!
//! Integrity: with passthrough the kernel reads the backing file without
//! the daemon, so `open` verifies the opened file once when
//! `verify_on_open` is on: buffered `pread`s of that very inode + the payload checksum
//! against its header (which also warms the page cache for the kernel's
//! read that follows); a mismatch is confirmed by G3's own verified read,
//! which quarantines it, and the open fails with EIO. Without passthrough
//! every read is served from a copy G3 verified at open.

mod config;
use crate::base::backend::EvictOutcome;
pub use crate::base::backend::{EvictHook, FetchHook, ImportHook};
use crate::base::tier::{Lookup, MissReason, PutOutcome};
use crate::tiers::g3::{EventSink, G3Event, G3Store, PutMeta, RemoveReason};
pub use config::{MountSection, PassthroughMode};
use kvtier_client::block::HEADER_BYTES;
use kvtier_client::proto::EvictTier;
use kvtier_client::{BlockKey, NamespaceId, Tier};
use kvtier_fs::{
    BlockReader, BlockStat, Error as FsError, EventLog, KvNamespace, MountGuard, MountOptions,
    OpenBlock, Passthrough, StagedBlock,
};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// What the mount asks of the node beyond G3.
#[derive(Clone, Default)]
pub struct MountHooks {
    /// Brings in blocks G3 lacks (G4, peers).
    pub fetch: Option<FetchHook>,
    /// Stores imports as offloads.
    pub import: Option<ImportHook>,
    /// Deletes across tiers (`rm`, `user.kvtier.evict`).
    pub evict: Option<EvictHook>,
}

impl std::fmt::Debug for MountHooks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MountHooks")
            .field("fetch", &self.fetch.is_some())
            .field("import", &self.import.is_some())
            .field("evict", &self.evict.is_some())
            .finish()
    }
}

/// Names removed with `rm` that the mount does not fetch back from G4 or
/// a peer by name, at most (oldest forgotten first).
pub const UNLINKED_NAMES_MAX: usize = 65_536;

/// Lines kept by `/.kvtier/events`.
pub const EVENT_LINES_MAX: usize = 10_000;

/// Bytes of verified block copies that fallback (non-passthrough) handles
/// may hold at once; an open beyond it fails with EBUSY.
pub const FALLBACK_HELD_BYTES_MAX: u64 = 1 << 30;

/// The event log behind `/.kvtier/events`, fed from G3 events.
#[derive(Debug)]
pub struct MountEvents {
    log: EventLog,
}

impl Default for MountEvents {
    fn default() -> Self {
        MountEvents {
            log: EventLog::new(EVENT_LINES_MAX),
        }
    }
}

impl MountEvents {
    /// Records one G3 event as a line (`stored` / `removed`). Call it from
    /// the G3 event sink.
    pub fn feed(&self, ev: &G3Event) {
        match ev {
            G3Event::Stored {
                ns, key, file_len, ..
            } => self
                .log
                .record("stored", ns, key, &format!("tier=g3 bytes={file_len}")),
            G3Event::Removed { ns, key, reason } => {
                let why = match reason {
                    RemoveReason::Evicted => "evicted",
                    RemoveReason::Deleted => "deleted",
                    RemoveReason::Corrupt => "corrupt",
                };
                self.log
                    .record("removed", ns, key, &format!("reason={why}"))
            }
        }
    }

    /// A G3 event sink that only feeds this log (for a daemon where nothing
    /// else listens to G3).
    pub fn sink(self: &Arc<Self>) -> EventSink {
        let me = Arc::clone(self);
        Arc::new(move |ev: G3Event| me.feed(&ev))
    }

    /// The log.
    pub fn log(&self) -> &EventLog {
        &self.log
    }
}

/// [`KvNamespace`] over G3.
pub struct G3Namespace {
    g3: Arc<G3Store>,
    fetch: Option<FetchHook>,
    import: Option<ImportHook>,
    evict: Option<EvictHook>,
    /// Blocks removed with `rm` (G3 only): not fetched back by name until
    /// this node holds them again (an import, a client's onboard).
    unlinked: Mutex<Unlinked>,
    events: Arc<MountEvents>,
    verify_on_open: bool,
    passthrough: AtomicBool,
    held_bytes: Arc<AtomicU64>,
    verify_failures: AtomicU64,
    fetched: AtomicU64,
    policy: Arc<crate::edges::access::Policy>,
}

impl std::fmt::Debug for G3Namespace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("G3Namespace")
            .field("root", &self.g3.config().root)
            .field("fetch", &self.fetch.is_some())
            .field("verify_on_open", &self.verify_on_open)
            .finish()
    }
}

fn fs_err(e: crate::Error) -> FsError {
    match e {
        crate::Error::NoSpace { path, op } => {
            FsError::io(op, path, std::io::Error::from_raw_os_error(libc::ENOSPC))
        }
        crate::Error::Io { op, path, source } => FsError::io(op, path, source),
        other => FsError::Unavailable {
            reason: other.to_string(),
        },
    }
}

/// Bounded set of names removed with `rm` (insertion order kept for
/// forgetting the oldest).
#[derive(Default)]
struct Unlinked {
    set: std::collections::HashSet<(NamespaceId, BlockKey)>,
    order: std::collections::VecDeque<(NamespaceId, BlockKey)>,
}

impl Unlinked {
    fn insert(&mut self, id: (NamespaceId, BlockKey)) {
        if self.set.insert(id) {
            self.order.push_back(id);
        }
        while self.order.len() > UNLINKED_NAMES_MAX {
            if let Some(old) = self.order.pop_front() {
                self.set.remove(&old);
            }
        }
    }

    fn remove(&mut self, id: &(NamespaceId, BlockKey)) {
        if self.set.remove(id) {
            self.order.retain(|x| x != id);
        }
    }
}

/// A verified copy of a block file served by the fallback path; `buf`
/// holds it at offset 1 (see [`G3Namespace::read_verified`]).
struct VerifiedCopy {
    buf: Vec<u8>,
    len: usize,
    held: Arc<AtomicU64>,
}

impl BlockReader for VerifiedCopy {
    fn read_at(&self, offset: u64, out: &mut [u8]) -> kvtier_fs::Result<usize> {
        if offset >= self.len as u64 {
            return Ok(0);
        }
        let at = offset as usize;
        let n = (self.len - at).min(out.len());
        out[..n].copy_from_slice(&self.buf[1 + at..1 + at + n]);
        Ok(n)
    }
}

impl Drop for VerifiedCopy {
    fn drop(&mut self) {
        self.held.fetch_sub(self.len as u64, Ordering::Relaxed);
    }
}

impl G3Namespace {
    /// The namespace over `g3`; `fetch` brings in blocks G3 lacks.
    pub fn new(
        g3: Arc<G3Store>,
        fetch: Option<FetchHook>,
        events: Arc<MountEvents>,
        verify_on_open: bool,
    ) -> Self {
        G3Namespace {
            g3,
            fetch,
            import: None,
            evict: None,
            unlinked: Mutex::new(Unlinked::default()),
            events,
            verify_on_open,
            passthrough: AtomicBool::new(false),
            held_bytes: Arc::new(AtomicU64::new(0)),
            verify_failures: AtomicU64::new(0),
            fetched: AtomicU64::new(0),
            policy: Arc::new(crate::edges::access::Policy::open()),
        }
    }

    /// Imports and removals through the node (see [`MountHooks`]).
    pub fn with_hooks(mut self, import: Option<ImportHook>, evict: Option<EvictHook>) -> Self {
        self.import = import;
        self.evict = evict;
        self
    }

    /// Who may see which namespace through the mount (default: everyone
    /// the mount's permission bits let in).
    pub fn with_policy(mut self, policy: Arc<crate::edges::access::Policy>) -> Self {
        self.policy = policy;
        self
    }

    /// Tells the namespace whether the mount reads through passthrough
    /// (else opens return a verified in-memory copy).
    pub fn set_passthrough(&self, on: bool) {
        self.passthrough.store(on, Ordering::Relaxed);
    }

    fn unlinked_has(&self, ns: &NamespaceId, key: &BlockKey) -> bool {
        self.unlinked
            .lock()
            .map(|u| u.set.contains(&(*ns, *key)))
            .unwrap_or(false)
    }

    fn unlinked_set(&self, ns: &NamespaceId, key: &BlockKey, gone: bool) {
        if let Ok(mut u) = self.unlinked.lock() {
            if gone {
                u.insert((*ns, *key));
            } else {
                u.remove(&(*ns, *key));
            }
        }
    }

    fn evict_via_node(
        &self,
        ns: &NamespaceId,
        key: &BlockKey,
        tier: EvictTier,
    ) -> kvtier_fs::Result<()> {
        let outcome = match &self.evict {
            Some(hook) => hook(ns, key, tier).map_err(fs_err)?,
            // G3 alone (no node behind the mount): only G3 exists.
            None if tier.g3() => {
                if self.g3.delete_block(ns, key).map_err(fs_err)? {
                    EvictOutcome::Evicted
                } else {
                    EvictOutcome::Absent
                }
            }
            None => EvictOutcome::Absent,
        };
        match outcome {
            EvictOutcome::Evicted => Ok(()),
            EvictOutcome::Absent => Err(FsError::block_not_found(ns, key)),
            EvictOutcome::Busy => Err(FsError::Busy {
                what: format!("block {key} is leased or pinned (unpin it, or wait for the lease)"),
            }),
        }
    }

    /// Verify failures seen at open (each one quarantined by G3).
    pub fn verify_failures(&self) -> u64 {
        self.verify_failures.load(Ordering::Relaxed)
    }

    fn g3_or_fetch(&self, ns: &NamespaceId, key: &BlockKey) -> kvtier_fs::Result<bool> {
        if self.g3.stat(ns, key).is_some() {
            return Ok(true);
        }
        if self.unlinked_has(ns, key) {
            return Ok(false);
        }
        let Some(hook) = &self.fetch else {
            return Ok(false);
        };
        match hook(ns, key) {
            Ok(true) => {
                self.fetched.fetch_add(1, Ordering::Relaxed);
                Ok(self.g3.stat(ns, key).is_some())
            }
            Ok(false) => Ok(false),
            Err(e) => {
                tracing::warn!(%ns, %key, error = %e, "mount: fetching a block into G3 failed");
                Err(fs_err(e))
            }
        }
    }

    /// Reads the whole block file through G3 with a buffered (page cache)
    /// read, verified; a mismatch is quarantined by G3 and refused (EIO).
    /// The copy lands at `buf[1..]`: an unaligned destination is what makes
    /// G3 read through the page cache rather than with O_DIRECT, so the
    /// kernel's passthrough read that follows finds the pages warm.
    fn read_verified(
        &self,
        ns: &NamespaceId,
        key: &BlockKey,
        len: u64,
    ) -> kvtier_fs::Result<Vec<u8>> {
        let mut buf = vec![0u8; len as usize + 1];
        match self.g3.read_into(ns, key, &mut buf[1..]).map_err(fs_err)? {
            Lookup::Hit(_) => Ok(buf),
            Lookup::Miss(MissReason::Corrupt) => {
                self.verify_failures.fetch_add(1, Ordering::Relaxed);
                Err(FsError::io(
                    "verifying block on open (checksum mismatch; the block was quarantined)",
                    self.g3.block_file_path(ns, key),
                    std::io::Error::from_raw_os_error(libc::EIO),
                ))
            }
            Lookup::Miss(_) => Err(FsError::block_not_found(ns, key)),
        }
    }
}

/// Bytes per `pread` of the open-time verification (sequential, so the
/// kernel's readahead streams the file into the page cache).
const VERIFY_CHUNK_BYTES: usize = 1 << 20;

impl G3Namespace {
    /// Checks the opened file itself (the inode the kernel will read):
    /// header names this block, length, zero padding and payload checksum.
    /// Buffered `pread`s, so the file lands in the page cache. `false` on
    /// any mismatch.
    fn verify_file(
        &self,
        ns: &NamespaceId,
        key: &BlockKey,
        file: &std::fs::File,
        file_len: u64,
    ) -> kvtier_fs::Result<bool> {
        use std::os::unix::fs::FileExt;
        let path = || self.g3.block_file_path(ns, key);
        let mut buf = vec![0u8; VERIFY_CHUNK_BYTES];
        let read = |buf: &mut [u8], off: u64| -> kvtier_fs::Result<usize> {
            let mut done = 0;
            while done < buf.len() {
                match file.read_at(&mut buf[done..], off + done as u64) {
                    Ok(0) => break,
                    Ok(n) => done += n,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(FsError::io("verifying block on open", path(), e)),
                }
            }
            Ok(done)
        };
        if read(&mut buf[..HEADER_BYTES], 0)? != HEADER_BYTES {
            return Ok(false);
        }
        let Ok(h) = kvtier_client::BlockHeader::decode(&buf[..HEADER_BYTES]) else {
            return Ok(false);
        };
        if h.namespace_id() != *ns || h.key != *key || h.file_len() != file_len {
            return Ok(false);
        }
        let want = h.payload_sum;
        let payload_end = HEADER_BYTES as u64 + h.payload_len;
        let mut hasher = h.payload_hasher();
        let mut off = HEADER_BYTES as u64;
        while off < file_len {
            let n = ((file_len - off) as usize).min(buf.len());
            if read(&mut buf[..n], off)? != n {
                return Ok(false);
            }
            let p = payload_end.saturating_sub(off).min(n as u64) as usize;
            hasher.update(&buf[..p]);
            if buf[p..n].iter().any(|&b| b != 0) {
                return Ok(false);
            }
            off += n as u64;
        }
        Ok(hasher.finish() == want)
    }
}

impl KvNamespace for G3Namespace {
    fn namespaces(&self) -> kvtier_fs::Result<Vec<NamespaceId>> {
        Ok(self.g3.namespaces())
    }

    fn list_blocks(
        &self,
        ns: &NamespaceId,
        shard: u8,
        after: Option<&BlockKey>,
        limit: usize,
    ) -> kvtier_fs::Result<Vec<BlockKey>> {
        // G3 lists a namespace in raw key order; a shard is the run of keys
        // whose first byte is `shard`, which starts right after the largest
        // key of the previous shard.
        let start = match after {
            Some(k) => Some(*k),
            None if shard == 0 => None,
            None => {
                let mut b = [0xffu8; kvtier_client::key::KEY_BYTES_MAX];
                b[0] = shard - 1;
                Some(BlockKey::from_bytes(&b).map_err(|e| FsError::Unavailable {
                    reason: e.to_string(),
                })?)
            }
        };
        let mut out = self.g3.list(ns, start.as_ref(), limit);
        out.retain(|k| k.as_bytes().first() == Some(&shard));
        Ok(out)
    }

    fn stat(&self, ns: &NamespaceId, key: &BlockKey) -> kvtier_fs::Result<Option<BlockStat>> {
        if !self.g3_or_fetch(ns, key)? {
            return Ok(None);
        }
        Ok(self.g3.stat(ns, key).map(|i| BlockStat {
            size_bytes: i.file_len,
            stored_unix_ms: i.created_unix_ms,
            tier: Tier::G3,
            payload_sum: i.payload_sum,
            hits: u64::from(i.hits),
            last_access_unix_ms: i.last_access_unix_ms,
            pinned: i.pinned,
            priority: i.priority,
        }))
    }

    fn open(&self, ns: &NamespaceId, key: &BlockKey) -> kvtier_fs::Result<OpenBlock> {
        if !self.g3_or_fetch(ns, key)? {
            return Err(FsError::block_not_found(ns, key));
        }
        let info = self
            .g3
            .stat(ns, key)
            .ok_or_else(|| FsError::block_not_found(ns, key))?;
        // A slotted block has no file of its own to pass through (its slab
        // holds other blocks): it is read as in fallback mode.
        if info.slotted || !self.passthrough.load(Ordering::Relaxed) {
            // Fallback: every byte the kernel gets comes from this verified
            // copy, never from a second, unchecked read of the disk.
            let len = info.file_len;
            let held = self.held_bytes.fetch_add(len, Ordering::Relaxed) + len;
            if held > FALLBACK_HELD_BYTES_MAX {
                self.held_bytes.fetch_sub(len, Ordering::Relaxed);
                return Err(FsError::Busy {
                    what: format!(
                        "{held} bytes of open block copies (limit {FALLBACK_HELD_BYTES_MAX}); close some files"
                    ),
                });
            }
            let buf = match self.read_verified(ns, key, len) {
                Ok(b) => b,
                Err(e) => {
                    self.held_bytes.fetch_sub(len, Ordering::Relaxed);
                    return Err(e);
                }
            };
            let copy = VerifiedCopy {
                buf,
                len: len as usize,
                held: Arc::clone(&self.held_bytes),
            };
            return Ok(OpenBlock::Reader {
                reader: Arc::new(copy),
                len_bytes: len,
            });
        }
        // Open first, then verify: the handle passed to the kernel is the
        // inode that was verified (blocks are write-once; an eviction in
        // between makes the verify miss and the open fail cleanly).
        let (file, info) = match self.g3.open_for_read(ns, key).map_err(fs_err)? {
            Lookup::Hit(x) => x,
            Lookup::Miss(_) => return Err(FsError::block_not_found(ns, key)),
        };
        if self.verify_on_open && !self.verify_file(ns, key, &file, info.file_len)? {
            // Confirm through G3's own verified read, which quarantines.
            self.read_verified(ns, key, info.file_len)?;
        }
        Ok(OpenBlock::File {
            file,
            offset_bytes: 0,
            len_bytes: info.file_len,
        })
    }

    fn import(&self, ns: &NamespaceId, block: StagedBlock) -> kvtier_fs::Result<()> {
        let header = block.header().clone();
        let key = header.key;
        let bytes = block.read_all()?;
        let end = HEADER_BYTES + header.payload_len as usize;
        let payload = bytes.get(HEADER_BYTES..end).ok_or(FsError::BadWrite {
            reason: "the staged file is shorter than its header declares".into(),
        })?;
        let stored = match &self.import {
            Some(hook) => hook(ns, &header, payload),
            None => self.g3.put_block(ns, &header, payload, PutMeta::default()),
        }
        .map_err(fs_err)?;
        match stored {
            PutOutcome::Stored | PutOutcome::StoredUnpinned => {
                self.unlinked_set(ns, &key, false);
                Ok(())
            }
            PutOutcome::AlreadyPresent => Err(FsError::Exists { ns: *ns, key }),
        }
    }

    /// `rm` (and the unlink half of `mv` out of the mount): removes the
    /// block from this node's G3 (G4 keeps its copy for other nodes and
    /// onboards) and from the mount's view: the name is not fetched back
    /// from G4 or a peer until this node holds the block again. Leased or
    /// pinned: EBUSY, nothing removed.
    fn remove(&self, ns: &NamespaceId, key: &BlockKey) -> kvtier_fs::Result<()> {
        self.evict_via_node(ns, key, EvictTier::G3)?;
        self.unlinked_set(ns, key, true);
        Ok(())
    }

    fn evict(&self, ns: &NamespaceId, key: &BlockKey, tier: EvictTier) -> kvtier_fs::Result<()> {
        self.evict_via_node(ns, key, tier)?;
        if tier.g3() {
            self.unlinked_set(ns, key, true);
        }
        Ok(())
    }

    fn space(&self) -> Option<kvtier_fs::Space> {
        let s = self.g3.stats();
        Some(kvtier_fs::Space {
            capacity_bytes: s.capacity_bytes,
            used_bytes: s.used_bytes,
            blocks: s.blocks,
        })
    }

    fn set_pinned(&self, ns: &NamespaceId, key: &BlockKey, pinned: bool) -> kvtier_fs::Result<()> {
        if self.g3.stat(ns, key).is_none() {
            return Err(FsError::block_not_found(ns, key));
        }
        if pinned {
            if !self.g3.pin(ns, key, None) {
                return Err(FsError::io(
                    "pinning (g3 pinned_budget_bytes is used up, or the block was just evicted)",
                    self.g3.block_file_path(ns, key),
                    std::io::Error::from_raw_os_error(libc::ENOSPC),
                ));
            }
        } else {
            self.g3.unpin(ns, key);
        }
        Ok(())
    }

    fn stats_text(&self) -> String {
        let s = self.g3.stats();
        format!(
            "store g3\nblocks {}\nbytes {}\ncapacity_bytes {}\ng3_hits {}\ng3_misses {}\n\
             evictions {}\nquarantined {}\nverify_on_open {}\nverify_failures {}\n\
             fetched_into_g3 {}\nfallback_held_bytes {}\n",
            s.blocks,
            s.used_bytes,
            s.capacity_bytes,
            s.hits,
            s.misses,
            s.evictions,
            s.quarantined,
            self.verify_on_open,
            self.verify_failures(),
            self.fetched.load(Ordering::Relaxed),
            self.held_bytes.load(Ordering::Relaxed),
        )
    }

    fn event_log(&self) -> &EventLog {
        self.events.log()
    }

    fn may_access(&self, caller: kvtier_fs::Caller, ns: Option<&NamespaceId>) -> bool {
        self.policy.may(caller.uid, caller.gid, ns)
    }

    /// With tenants, deleting is an admin's (as `kvtier evict` is): a
    /// tenant's `rm` is EPERM.
    fn may_remove(&self, caller: kvtier_fs::Caller) -> bool {
        self.policy.may(caller.uid, caller.gid, None)
    }

    fn checks_callers(&self) -> bool {
        self.policy.is_multi_tenant()
    }
}

/// A mounted G3. Dropping it unmounts.
#[derive(Debug)]
pub struct MountHandle {
    guard: Option<MountGuard>,
    namespace: Arc<G3Namespace>,
    events: Arc<MountEvents>,
}

impl MountHandle {
    /// Where it is mounted.
    pub fn mountpoint(&self) -> Option<&Path> {
        self.guard.as_ref().map(|g| g.mountpoint())
    }

    /// Whether reads use FUSE passthrough.
    pub fn passthrough_active(&self) -> bool {
        self.guard.as_ref().is_some_and(|g| g.passthrough_active())
    }

    /// The event log to feed from the G3 event sink.
    pub fn events(&self) -> Arc<MountEvents> {
        Arc::clone(&self.events)
    }

    /// The namespace the mount shows.
    pub fn namespace(&self) -> Arc<G3Namespace> {
        Arc::clone(&self.namespace)
    }

    /// The adapter's counters.
    pub fn counters(&self) -> kvtier_fs::Counters {
        self.guard
            .as_ref()
            .map(|g| g.counters())
            .unwrap_or_default()
    }

    /// Where /metrics reads the mount's figures (`kvtier_mount_*`).
    pub fn figures_source(&self) -> crate::edges::metrics::MountFiguresFn {
        let fs = self.guard.as_ref().map(|g| g.counters_source());
        let ns = Arc::clone(&self.namespace);
        Arc::new(move || crate::edges::metrics::MountFigures {
            fs: fs.as_ref().map(|f| f()).unwrap_or_default(),
            verify_failures: ns.verify_failures(),
        })
    }

    /// Unmounts now.
    pub fn unmount(mut self) -> crate::Result<()> {
        match self.guard.take() {
            Some(g) => g.unmount().map_err(mount_err),
            None => Ok(()),
        }
    }
}

fn mount_err(e: FsError) -> crate::Error {
    crate::Error::Mount(Box::new(e))
}

/// Builds the mount options `[mount]` asks for; staging goes under the G3
/// root (same filesystem, never inside the mount).
pub fn mount_options(section: &MountSection, g3_root: &Path) -> crate::Result<MountOptions> {
    let mut o = MountOptions {
        allow_other: section.allow_other,
        read_only: section.read_only,
        passthrough: match section.passthrough {
            PassthroughMode::Auto => Passthrough::Auto,
            PassthroughMode::Off => Passthrough::Off,
            PassthroughMode::Required => Passthrough::Required,
        },
        staging_dir: g3_root.join("mount-staging"),
        fsname: "kvtier".into(),
        ..MountOptions::default()
    };
    if let Some(u) = section.uid {
        o.uid = u;
    }
    if let Some(g) = section.gid {
        o.gid = g;
    }
    o.file_mode = section.file_mode_bits()?;
    o.dir_mode = section.dir_mode_bits()?;
    std::fs::create_dir_all(&o.staging_dir)
        .map_err(|e| crate::Error::io("creating the mount staging dir", &o.staging_dir, e))?;
    Ok(o)
}

/// Mounts `g3` at `section.dir` (a stale mount left there by a crashed
/// daemon is cleaned first; the directory is created if missing). The G3
/// event sink is NOT set: the caller feeds [`MountHandle::events`] from
/// its sink (or sets `handle.events().sink()` when nothing else listens).
pub fn start(
    section: &MountSection,
    g3: Arc<G3Store>,
    fetch: Option<FetchHook>,
) -> crate::Result<MountHandle> {
    start_with_policy(
        section,
        g3,
        fetch,
        Arc::new(crate::edges::access::Policy::open()),
    )
}

/// [`start`] with the daemon's tenants: a uid sees and touches only its
/// namespaces through the mount, `allow_other` or not.
pub fn start_with_policy(
    section: &MountSection,
    g3: Arc<G3Store>,
    fetch: Option<FetchHook>,
    policy: Arc<crate::edges::access::Policy>,
) -> crate::Result<MountHandle> {
    let hooks = MountHooks {
        fetch,
        ..MountHooks::default()
    };
    start_with_hooks(section, g3, hooks, policy)
}

/// [`start_with_policy`] with the node behind the mount: imports stored
/// as offloads, `rm` and `user.kvtier.evict` through the node's evict.
/// A mount point where a live filesystem is mounted (another kvtierd's
/// mount, say) is refused: mounting over it would hide its blocks.
pub fn start_with_hooks(
    section: &MountSection,
    g3: Arc<G3Store>,
    hooks: MountHooks,
    policy: Arc<crate::edges::access::Policy>,
) -> crate::Result<MountHandle> {
    let dir: PathBuf = section.dir.clone();
    let cleaned = kvtier_fs::clean_stale_mount(&dir).map_err(mount_err)?;
    if cleaned {
        tracing::warn!(dir = %dir.display(), "mount: cleaned a stale mount left by an earlier daemon");
    }
    // Only a FUSE mount is refused: a bind mount or volume at the mount
    // point (a container's hostPath) is where kvtierd is meant to mount.
    if let Some(what) = kvtier_fs::mounted_at(&dir)
        .map_err(mount_err)?
        .filter(|m| m.is_fuse())
    {
        return Err(crate::Error::Config {
            key: "mount.dir".into(),
            problem: format!(
                "{} is in use: a {what} is mounted there (another kvtierd's mount?); \
                 stop it or choose another mount.dir / --mount",
                dir.display()
            ),
        });
    }
    let opts = mount_options(section, &g3.config().root)?;
    std::fs::create_dir_all(&dir)
        .map_err(|e| crate::Error::io("creating the mount point", &dir, e))?;
    let events = Arc::new(MountEvents::default());
    let namespace = Arc::new(
        G3Namespace::new(g3, hooks.fetch, Arc::clone(&events), section.verify_on_open)
            .with_hooks(hooks.import, hooks.evict)
            .with_policy(policy),
    );
    let guard = kvtier_fs::mount(namespace.clone(), &dir, &opts).map_err(mount_err)?;
    namespace.set_passthrough(guard.passthrough_active());
    tracing::info!(
        dir = %dir.display(),
        passthrough = guard.passthrough_active(),
        verify_on_open = section.verify_on_open,
        "mount: G3 mounted"
    );
    Ok(MountHandle {
        guard: Some(guard),
        namespace,
        events,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mount_options_follow_the_section() {
        let dir = tempfile::tempdir().unwrap();
        let s = crate::app::config::Config::from_toml(
            "[mount]\ndir = \"/mnt/kv\"\nallow_other = true\nread_only = true\nuid = 7\ngid = 8\n\
             file_mode = \"0440\"\ndir_mode = \"0750\"\npassthrough = \"required\"\n\
             verify_on_open = false\n",
        )
        .unwrap()
        .mount;
        assert!(s.enabled() && !s.verify_on_open);
        let o = mount_options(&s, dir.path()).unwrap();
        assert!(o.allow_other && o.read_only);
        assert_eq!(
            (o.uid, o.gid, o.file_mode, o.dir_mode),
            (7, 8, 0o440, 0o750)
        );
        assert_eq!(o.passthrough, Passthrough::Required);
        assert_eq!(o.staging_dir, dir.path().join("mount-staging"));
        assert!(o.staging_dir.is_dir());
        let d = MountSection::default();
        assert!(!d.enabled() && d.verify_on_open);
        assert_eq!(d.passthrough, PassthroughMode::Auto);
        assert_eq!(mount_options(&d, dir.path()).unwrap().file_mode, 0o444);
    }

    #[test]
    fn events_lines_name_kind_and_reason() {
        let ev = MountEvents::default();
        let ns = NamespaceId([3; 16]);
        let key = BlockKey::from_u64(5);
        ev.feed(&G3Event::Stored {
            ns,
            key,
            parent: None,
            file_len: 8192,
        });
        ev.feed(&G3Event::Removed {
            ns,
            key,
            reason: RemoveReason::Evicted,
        });
        let text = String::from_utf8(ev.log().read_at(0, 4096)).unwrap();
        let path = kvtier_client::block_path(&ns, &key);
        assert!(
            text.contains(&format!("stored {path} tier=g3 bytes=8192")),
            "{text}"
        );
        assert!(
            text.contains(&format!("removed {path} reason=evicted")),
            "{text}"
        );
    }
}
