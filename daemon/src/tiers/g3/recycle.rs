//! The recycle pool: evicted block files kept in `recycle/` and reused,
//! overwritten in place, by later offloads of the same file size.
//!
//! Why (measured; docs/internals/g3.md, "Recycled block files"): a
//! fresh block file pays extent allocation (its `fdatasync` is a journal
//! commit) and, for its rename to be durable, an fsync of its shard
//! directory (another journal commit) before the ack. A recycled file has
//! a durable name (in `recycle/`) and written extents of the right size,
//! so overwriting it and `fdatasync` (or O_DSYNC) makes the new block
//! durable with no metadata change at all: the ack needs no directory
//! fsync. Its rename to `blocks/...` still happens before the ack (lookups,
//! the mount and `ls` see the block at its name at once); that rename is
//! made durable later (close, before the clean marker), and until then a
//! power cut leaves the block under its `recycle/` name, where the open
//! finds it, verifies it and renames it into place ([`G3Store::scan_recycled`]).
//!
//! Invariants:
//! - a file is reused only once its `recycle/` name and its removal from
//!   `blocks/` are both durable (`RecycleDirFsync` of `recycle/` and of the
//!   shard directories it left): otherwise a power cut could give the
//!   inode, now holding another block, back its old block name;
//! - a file is retired into the pool only when nobody has it open (a
//!   write lease, `F_SETLEASE F_WRLCK`, is granted only then): a mount
//!   reader holding it through FUSE passthrough or a client's direct-read
//!   fd keeps its bytes (the file is unlinked instead). Filesystems without
//!   leases disable the pool;
//! - its header page is zeroed once its retirement is durable (not
//!   synced: a power cut may bring the old, valid block back, which is
//!   correct data for its key and is put back at open), so the open does
//!   not read the whole pool; zeroed earlier, a power cut could give the
//!   blanked inode its old name in `blocks/` back (found by the harness).
//!   Retirements are settled by the next offload of the same size or,
//!   past `recycle_unsettled_bytes_max`, at once: a crash start verifies
//!   every unsettled file in full;
//! - the fsync of `recycle/` also makes the removal of names that recycled
//!   writes renamed out of it durable, so their new directories are
//!   fsynced first (settle, close), and a recycled write holds
//!   `recycle_settle` (read) from noting its new directory to its rename;
//! - the pool's bytes count against `capacity_bytes` with the blocks':
//!   `make_room` drops pool files before it evicts, and at most
//!   `recycle_pool_bytes` are kept.

use super::seam::{SyncSite, Unlink};
use super::G3Store;
use crate::base::error::{Error, Result};
use kvtier_client::block::HEADER_BYTES;
use kvtier_client::BlockHeader;
use std::collections::HashMap;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;

/// A pooled file.
#[derive(Debug, Clone)]
struct Spare {
    path: PathBuf,
    /// The shard directory it was retired from (its removal there must be
    /// durable before reuse), if any.
    from_dir: Option<PathBuf>,
}

/// The pool's state.
#[derive(Debug, Default)]
pub(super) struct RecyclePool {
    /// Files whose retirement is durable, by file length.
    ready: HashMap<u64, Vec<Spare>>,
    /// Files retired since the last `RecycleDirFsync`, by file length.
    pending: HashMap<u64, Vec<Spare>>,
    /// Bytes of every pooled file.
    bytes: u64,
    /// Off for good: the filesystem refused a lease.
    disabled: bool,
}

impl RecyclePool {
    /// Pooled files, reusable or not yet.
    fn files(&self) -> usize {
        self.ready
            .values()
            .chain(self.pending.values())
            .map(Vec::len)
            .sum()
    }

    fn push_pending(&mut self, len: u64, s: Spare) {
        self.pending.entry(len).or_default().push(s);
        self.bytes += len;
    }

    /// Bytes of the files whose retirement is not durable yet.
    fn pending_bytes(&self) -> u64 {
        self.pending
            .iter()
            .map(|(len, v)| len * v.len() as u64)
            .sum()
    }
}

/// Recycled writes and pool traffic since open.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RecycleCounts {
    /// Offloads that overwrote a pooled file.
    pub recycled_writes: u64,
    /// Files retired into the pool.
    pub retired: u64,
    /// Pooled files unlinked (room needed, the bound, refused leases).
    pub dropped: u64,
    /// Files in the pool now.
    pub files: u64,
    /// Bytes in the pool now.
    pub bytes: u64,
}

/// `len.pid.seq`: the file length first, so the open can pool a file by
/// its name.
fn spare_len(path: &Path) -> Option<u64> {
    path.file_name()?.to_str()?.split('.').next()?.parse().ok()
}

impl G3Store {
    /// Bytes in the pool now (counted against capacity by `make_room`).
    pub(super) fn recycle_bytes(&self) -> u64 {
        self.recycle.lock().map(|p| p.bytes).unwrap_or(0)
    }

    /// Counters of the pool.
    pub fn recycle_counts(&self) -> RecycleCounts {
        let (files, bytes) = self
            .recycle
            .lock()
            .map(|p| (p.files() as u64, p.bytes))
            .unwrap_or((0, 0));
        RecycleCounts {
            recycled_writes: self.counters.recycled_writes.load(Ordering::Relaxed),
            retired: self.counters.recycle_retired.load(Ordering::Relaxed),
            dropped: self.counters.recycle_dropped.load(Ordering::Relaxed),
            files,
            bytes,
        }
    }

    fn pool_enabled(&self) -> bool {
        self.cfg.recycle_bound_bytes() > 0
    }

    /// Moves the block file at `path` (of `len` bytes) into the pool
    /// instead of unlinking it, when the pool has room and nobody has the
    /// file open. `Ok(true)`: the name is gone from `blocks/` (retired or,
    /// when it could not be pooled, unlinked); `Ok(false)`: it was gone.
    pub(super) fn retire_or_unlink(&self, path: &Path, len: u64) -> std::io::Result<bool> {
        let room = self.pool_enabled()
            && self.recycle.lock().is_ok_and(|p| {
                !p.disabled
                    && p.bytes + len <= self.cfg.recycle_bound_bytes()
                    && p.files() < self.cfg.recycle_pool_files_max
            });
        if !room {
            return match self.fs.remove_file(path, Unlink::Block) {
                Ok(()) => Ok(true),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
                Err(e) => Err(e),
            };
        }
        let seq = self.counters.seq.fetch_add(1, Ordering::Relaxed);
        let spare = self
            .recycle_dir
            .join(format!("{len}.{}.{seq}", std::process::id()));
        match self.fs.retire(path, &spare) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(false),
            Err(e) => return Err(e),
        }
        // From here the block is gone from `blocks/`; what is left is
        // whether the inode may be reused.
        match self.claim_inode(&spare) {
            Ok(()) => {
                let over = self.recycle.lock().is_ok_and(|mut p| {
                    p.push_pending(
                        len,
                        Spare {
                            path: spare,
                            from_dir: path.parent().map(Path::to_path_buf),
                        },
                    );
                    p.pending_bytes() > self.cfg.recycle_unsettled_bytes_max
                });
                self.counters
                    .recycle_retired
                    .fetch_add(1, Ordering::Relaxed);
                if over {
                    // Bounds what a crash start verifies (config.rs).
                    self.settle_retired();
                }
            }
            Err(e) => {
                if e.raw_os_error() != Some(libc::EAGAIN) {
                    tracing::warn!(error = %e, "g3: the filesystem refuses write leases; evicted files are unlinked, not recycled");
                    if let Ok(mut p) = self.recycle.lock() {
                        p.disabled = true;
                    }
                }
                let _ = self.fs.remove_file(&spare, Unlink::Temp);
                self.counters
                    .recycle_dropped
                    .fetch_add(1, Ordering::Relaxed);
            }
        }
        Ok(true)
    }

    /// Proves nobody else has `spare` open: a write lease is granted only
    /// then, and nobody can open it by name any more.
    fn claim_inode(&self, spare: &Path) -> std::io::Result<()> {
        let f = std::fs::OpenOptions::new()
            .write(true)
            .custom_flags(libc::O_CLOEXEC)
            .open(spare)?;
        let fd = f.as_raw_fd();
        // SAFETY: fcntl on an fd we own; no memory is passed.
        if unsafe { libc::fcntl(fd, libc::F_SETLEASE, libc::F_WRLCK) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: as above (closing the fd would drop it too).
        unsafe { libc::fcntl(fd, libc::F_SETLEASE, libc::F_UNLCK) };
        Ok(())
    }

    /// Zeroes a settled spare's header page, so that the next open does
    /// not take it for a block (not synced: an old header that comes back
    /// after a power cut is a correct block, put back at open). Only once
    /// settled: before, a power cut could give the zeroed inode its old
    /// block name back.
    fn blank_header(&self, spare: &Path) {
        let r = self
            .fs
            .open_existing(spare, libc::O_CLOEXEC)
            .and_then(|f| f.write_all_at(&[0u8; HEADER_BYTES], 0));
        if let Err(e) = r {
            tracing::debug!(path = %spare.display(), error = %e, "g3: cannot blank a recycled file's header");
        }
    }

    /// Takes a pooled file of exactly `len` bytes for a write, making the
    /// pending retirements durable first when no ready one is left. `None`:
    /// write a fresh file. The file's bytes leave the pool's count.
    pub(super) fn take_spare(&self, len: u64) -> Option<PathBuf> {
        if !self.pool_enabled() {
            return None;
        }
        {
            let mut p = self.recycle.lock().ok()?;
            if let Some(s) = p.ready.get_mut(&len).and_then(Vec::pop) {
                p.bytes -= len;
                return Some(s.path);
            }
            if p.pending.get(&len).is_none_or(Vec::is_empty) {
                return None;
            }
        }
        self.settle_retired();
        let mut p = self.recycle.lock().ok()?;
        let s = p.ready.get_mut(&len).and_then(Vec::pop)?;
        p.bytes -= len;
        Some(s.path)
    }

    /// fsyncs every directory with unsynced entry changes except
    /// `recycle/` (see `settle_retired`), at once.
    fn sync_unsynced_dirs_but_recycle(&self) -> std::io::Result<()> {
        let dirs: Vec<PathBuf> = match self.unsynced_removals.lock() {
            Ok(mut set) => {
                let d: Vec<PathBuf> = set
                    .iter()
                    .filter(|d| **d != self.recycle_dir)
                    .cloned()
                    .collect();
                for x in &d {
                    set.remove(x);
                }
                d
            }
            Err(_) => return Err(std::io::Error::other("g3 removals lock poisoned")),
        };
        let refs: Vec<&Path> = dirs.iter().map(PathBuf::as_path).collect();
        match self.sync_dirs_at_once(&refs, SyncSite::RecycleDirFsync) {
            None => Ok(()),
            Some((_, e)) => {
                // Still unsynced: back into the set for close.
                if let Ok(mut set) = self.unsynced_removals.lock() {
                    set.extend(dirs.iter().cloned());
                }
                if e.kind() == std::io::ErrorKind::NotFound {
                    return Ok(());
                }
                Err(e)
            }
        }
    }

    /// Unlinks a spare taken for a write that will not happen (its bytes
    /// already left the pool's count).
    pub(super) fn drop_taken_spare(&self, spare: &Path) {
        let _ = self.fs.remove_file(spare, Unlink::Temp);
        self.note_removal(spare);
        self.counters
            .recycle_dropped
            .fetch_add(1, Ordering::Relaxed);
    }

    /// Makes every pending retirement durable (fsync of `recycle/` and of
    /// the shard directories the files left, at once) and marks them
    /// ready. On failure they stay pending (and are never reused).
    pub(super) fn settle_retired(&self) {
        let Ok(_one) = self.recycle_settle.write() else {
            return;
        };
        let batch: HashMap<u64, Vec<Spare>> = match self.recycle.lock() {
            Ok(mut p) if !p.pending.is_empty() => std::mem::take(&mut p.pending),
            _ => return,
        };
        // The fsync of `recycle/` below also makes durable the removal of
        // every name recycled writes renamed out of it: their new names in
        // `blocks/` must be durable first, else a power cut between the two
        // leaves an acknowledged block with no name at all (found by the
        // power-loss harness).
        if let Err(e) = self.sync_unsynced_dirs_but_recycle() {
            tracing::warn!(error = %e, "g3: fsync before settling the recycle pool failed");
            if let Ok(mut p) = self.recycle.lock() {
                for (len, v) in batch {
                    p.pending.entry(len).or_default().extend(v);
                }
            }
            return;
        }
        let mut dirs: Vec<&Path> = batch
            .values()
            .flatten()
            .filter_map(|s| s.from_dir.as_deref())
            .collect();
        dirs.push(&self.recycle_dir);
        dirs.sort_unstable();
        dirs.dedup();
        let failed = self.sync_dirs_at_once(&dirs, SyncSite::RecycleDirFsync);
        let Ok(mut p) = self.recycle.lock() else {
            return;
        };
        if failed.is_none() {
            drop(p);
            for s in batch.values().flatten() {
                self.blank_header(&s.path);
            }
            p = match self.recycle.lock() {
                Ok(p) => p,
                Err(_) => return,
            };
        }
        let to = if let Some((d, e)) = failed {
            // Leave them unusable rather than guess; a pooled file is only
            // room, so nothing acknowledged depends on it.
            tracing::warn!(dir = %d.display(), error = %e, "g3: fsync for the recycle pool failed; those files are not reused");
            &mut p.pending
        } else {
            &mut p.ready
        };
        for (len, v) in batch {
            to.entry(len).or_default().extend(v);
        }
    }

    /// Unlinks every pooled file (the filesystem is full before the tier
    /// is: the disk space is needed now).
    pub(crate) fn release_recycled(&self) {
        self.drop_spares(u64::MAX);
    }

    /// Unlinks pooled files until `bytes` are freed or the pool is empty
    /// (room for a fresh write: the pool's bytes count against capacity).
    pub(super) fn drop_spares(&self, bytes: u64) {
        let mut gone = Vec::new();
        if let Ok(mut guard) = self.recycle.lock() {
            let p = &mut *guard;
            let mut freed = 0;
            for map in [&mut p.pending, &mut p.ready] {
                for (len, v) in map.iter_mut() {
                    while freed < bytes {
                        let Some(s) = v.pop() else { break };
                        freed += *len;
                        gone.push(s.path);
                    }
                }
            }
            p.bytes -= freed.min(p.bytes);
        }
        for g in gone {
            let _ = self.fs.remove_file(&g, Unlink::Temp);
            self.note_removal(&g);
            self.counters
                .recycle_dropped
                .fetch_add(1, Ordering::Relaxed);
        }
    }

    /// At open, after recovery: every file in `recycle/` is either a block
    /// acknowledged whose rename into `blocks/` a power cut took back
    /// (a valid header, the name in `blocks/` absent: verified and renamed
    /// into place, indexed), a second name of a block file (the name in
    /// `blocks/` exists: unlinked), or room (pooled, made durable before
    /// use). Returns the blocks put back. After a clean close (`trusted`)
    /// no header is read: close made every rename out of `recycle/`
    /// durable before the marker, so nothing here is a block the index
    /// lacks (a valid header is an evicted block whose blanking was lost:
    /// room), and the open stays as fast as the index load.
    pub(super) fn scan_recycled(&self, trusted: bool) -> Result<u64> {
        let rd = match std::fs::read_dir(&self.recycle_dir) {
            Ok(rd) => rd,
            Err(e) => return Err(Error::io("listing", &self.recycle_dir, e)),
        };
        let mut restored = 0;
        let mut spares: Vec<(u64, PathBuf)> = Vec::new();
        let mut head = vec![0u8; HEADER_BYTES];
        for e in rd {
            let e = e.map_err(|e| Error::io("listing", &self.recycle_dir, e))?;
            let path = e.path();
            let size = e.metadata().map(|m| m.len()).unwrap_or(0);
            let named = spare_len(&path);
            let header = if trusted {
                None
            } else {
                super::recover::open_nofollow(&path)
                    .and_then(|f| f.read_exact_at(&mut head, 0))
                    .ok()
                    .and_then(|()| BlockHeader::decode(&head).ok())
                    .filter(|h| h.file_len() == size)
            };
            if let Some(h) = header {
                let ns = h.namespace_id();
                let final_path = self.block_file_path(&ns, &h.key);
                if final_path.exists() {
                    self.fs
                        .remove_file(&path, Unlink::Temp)
                        .map_err(|err| Error::io("removing", &path, err))?;
                    continue;
                }
                if self.restore_recycled(&path, &final_path, &h)? {
                    restored += 1;
                    continue;
                }
            }
            match named {
                Some(len) if len == size && len >= 2 * HEADER_BYTES as u64 => {
                    spares.push((len, path));
                }
                _ => {
                    self.fs
                        .remove_file(&path, Unlink::Temp)
                        .map_err(|err| Error::io("removing", &path, err))?;
                }
            }
        }
        // Over the bound (a smaller setting than last time): drop the rest.
        let mut kept = Vec::new();
        let mut bytes = 0;
        for (len, path) in spares {
            if self.pool_enabled()
                && bytes + len <= self.cfg.recycle_bound_bytes()
                && kept.len() < self.cfg.recycle_pool_files_max
            {
                bytes += len;
                kept.push((len, path));
            } else {
                let _ = self.fs.remove_file(&path, Unlink::Temp);
            }
        }
        // Names found here after a crash (or kill -9) may not be durable
        // yet: make them so before any of them is reused.
        self.fs
            .sync_dir(&self.recycle_dir, SyncSite::RecycleDirFsync)
            .map_err(|e| Error::io("flushing directory", &self.recycle_dir, e))?;
        if let Ok(mut p) = self.recycle.lock() {
            for (len, path) in kept {
                p.ready.entry(len).or_default().push(Spare {
                    path,
                    from_dir: None,
                });
                p.bytes += len;
            }
        }
        Ok(restored)
    }

    /// Verifies a recycled file that holds block `h` and renames it to its
    /// name in `blocks/` (durably), indexing it. `Ok(false)`: it does not
    /// verify (a write that was never acknowledged): room.
    fn restore_recycled(&self, path: &Path, final_path: &Path, h: &BlockHeader) -> Result<bool> {
        let ns = h.namespace_id();
        if self.verify_file(path, &ns, &h.key).is_err() {
            return Ok(false);
        }
        let dir = final_path
            .parent()
            .unwrap_or(&self.blocks_dir)
            .to_path_buf();
        self.ensure_dir(&dir)?;
        self.fs
            .rename_noreplace(path, final_path)
            .map_err(|e| Error::io("renaming into place", final_path, e))?;
        for d in [&dir, &self.recycle_dir] {
            self.fs
                .sync_dir(d, SyncSite::RecycleDirFsync)
                .map_err(|e| Error::io("flushing directory", d, e))?;
        }
        self.adopt_verified(&ns, h)?;
        tracing::info!(%ns, key = %h.key, "g3: put back an acknowledged block found in recycle/");
        Ok(true)
    }
}
