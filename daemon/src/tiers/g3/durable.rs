//! One block file made durable: the temp file written through pool buffers
//! (payload hashed in the pool buffer, after the copy), the group flush
//! window's `syncfs`, `fdatasync` or O_DSYNC, the no-replace
//! rename into `blocks/`, shard directories created durably, and the group
//! commit leader's directory fsyncs and redb transaction.

use super::engine::CHUNK_BYTES;
use super::index::Record;
use super::seam::{SyncSite, Unlink};
use super::{group, lock_err, G3Store, SyncMode};
use crate::base::error::{Error, Result};
use crate::base::tier::PutOutcome;
use kvtier_client::block::HEADER_BYTES;
use kvtier_client::{BlockHeader, NamespaceId};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;

/// The index id of a block.
fn id_of(ns: &NamespaceId, header: &BlockHeader) -> u64 {
    super::index::digest(ns, &header.key).0
}

/// Where a written block file was renamed to.
pub(super) struct Placed {
    /// Its shard directory.
    pub(super) dir: PathBuf,
    /// It overwrote a recycled file, whose `recycle/` name was durable:
    /// the ack needs no fsync of `dir` (the rename is made durable at
    /// close; a power cut before leaves it in `recycle/`, put back at the
    /// next open).
    pub(super) recycled: bool,
}

/// How long a put of a key another put is writing waits for that put's
/// outcome.
pub(super) const WRITER_WAIT_MS: u64 = 10_000;

/// Directory fsyncs one group commit keeps in flight at most (threads).
const COMMIT_FSYNCS_IN_FLIGHT_MAX: usize = 32;

/// Pool buffers one write takes at most.
const BUFS_PER_WRITE: usize = 4;

impl G3Store {
    /// Writes the temp file, makes it durable and renames it into place.
    /// `Ok(Some(dir))`: renamed into `dir`, whose fsync (group commit) makes
    /// the rename durable; `Ok(None)`: the name already existed. Only the
    /// put that claimed the id first writes it (write.rs), so an existing
    /// name the index lacks is an orphan (a crash between rename and index
    /// commit) and is replaced by this verified file instead of answered
    /// AlreadyPresent (which lookups would contradict).
    pub(super) fn write_durable(
        &self,
        ns: &NamespaceId,
        header: &BlockHeader,
        payload: &[u8],
        spare: Option<PathBuf>,
    ) -> Result<Option<Placed>> {
        let recycled = spare.is_some();
        let tmp = match spare {
            Some(p) => p,
            None => {
                let seq = self.counters.seq.fetch_add(1, Ordering::Relaxed);
                self.tmp_dir.join(format!(
                    "{:016x}.{}.{seq}",
                    id_of(ns, header),
                    std::process::id()
                ))
            }
        };
        let mut flags = libc::O_CLOEXEC;
        if self.direct_ok {
            flags |= libc::O_DIRECT;
        }
        let dsync = match self.sync_mode {
            SyncMode::ODsync => true,
            SyncMode::Fdatasync | SyncMode::Group => false,
            SyncMode::Auto => header.file_len() <= CHUNK_BYTES as u64,
        };
        if dsync {
            flags |= libc::O_DSYNC;
        }
        let file = if recycled {
            // A pooled file of exactly this length, written extents: an
            // overwrite in place allocates nothing (recycle.rs).
            self.fs.open_existing(&tmp, flags).map_err(|e| {
                let _ = self.fs.remove_file(&tmp, Unlink::Temp);
                Error::io("opening recycled file", &tmp, e)
            })?
        } else {
            self.fs
                .create_new(&tmp, flags)
                .map_err(|e| Error::io("creating", &tmp, e))?
        };
        let cleanup = |e: Error| {
            let _ = self.fs.remove_file(&tmp, Unlink::Temp);
            e
        };
        self.write_and_flush(&file, &tmp, header, payload, dsync)
            .map_err(cleanup)?;
        drop(file);
        self.place(ns, header, &tmp, recycled).map_err(cleanup)
    }

    /// Writes header, payload and padding into the open temp file through
    /// the pool's aligned buffers, checks the checksum of the bytes written
    /// and makes them durable (O_DSYNC, the group's syncfs or fdatasync).
    /// A failed flush poisons the store.
    fn write_and_flush(
        &self,
        file: &std::fs::File,
        tmp: &std::path::Path,
        header: &BlockHeader,
        payload: &[u8],
        dsync: bool,
    ) -> Result<()> {
        self.write_block_bytes(file.as_raw_fd(), 0, tmp, header, payload, dsync)?;
        // The data is durable before the rename: a name that survives a
        // power cut always has its bytes (else a restart finds a torn file
        // under a block's name).
        let synced = if dsync {
            Ok(())
        } else if self.sync_mode == SyncMode::Group {
            // One syncfs for every writer waiting, across requests and
            // clients (group.rs): any fd on the filesystem names it.
            let fd = file.as_raw_fd();
            self.flush_window.join(|| self.engine.sync_fs(fd))
        } else {
            self.engine.sync_data(file.as_raw_fd())
        };
        if let Err(e) = synced {
            let err = Error::io("flushing", tmp, e);
            if !matches!(err, Error::NoSpace { .. }) {
                self.poison(format!("data flush of {}: {err}", tmp.display()));
            }
            return Err(err);
        }
        Ok(())
    }

    /// Writes a block's bytes (header, payload, zero padding) at offset
    /// `at` of `fd` (a block file, or a slot of a slab) through the pool's
    /// aligned buffers, and checks the checksum of the bytes written (our
    /// copy) against the header. Not flushed. `dsync`: the fd is O_DSYNC,
    /// so a failed write may be a failed flush (poisons the store).
    pub(super) fn write_block_bytes(
        &self,
        fd: std::os::fd::RawFd,
        at: u64,
        tmp: &std::path::Path,
        header: &BlockHeader,
        payload: &[u8],
        dsync: bool,
    ) -> Result<()> {
        let head = header.encode();
        let plen = payload.len() as u64;
        let file_len = header.file_len();
        let mut hasher = header.payload_hasher();
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
                self.fs.payload_copied(off);
                // Hash our copy, the bytes the kernel will write: `payload`
                // may be a client's shared memory, which it can still
                // change, so hashing it would ack a block whose file fails
                // its own checksum.
                hasher.update(own);
            }
        };
        let mut bufs = self.pool.take(BUFS_PER_WRITE);
        if bufs.is_empty() {
            return Err(lock_err("g3 buffer pool"));
        }
        let wrote = self
            .engine
            .write_file(fd, at, file_len, &mut bufs, &mut fill);
        self.pool.give(bufs);
        if let Err(e) = wrote {
            let err = Error::io("writing", tmp, e);
            if dsync && !matches!(err, Error::NoSpace { .. }) {
                // Under O_DSYNC a failed write may be a failed flush.
                self.poison(format!("O_DSYNC write of {}: {err}", tmp.display()));
            }
            return Err(err);
        }
        if hasher.finish() != header.payload_sum {
            return Err(Error::InvalidInput {
                what: "payload",
                reason: format!("checksum does not match the header of block {}", header.key),
            });
        }
        Ok(())
    }

    /// Renames the durable temp file to the block's name (see
    /// [`Self::write_durable`] for the outcomes). On `Err` the caller
    /// removes the temp file; on `Ok` it is gone (renamed or removed here).
    fn place(
        &self,
        ns: &NamespaceId,
        header: &BlockHeader,
        tmp: &std::path::Path,
        recycled: bool,
    ) -> Result<Option<Placed>> {
        let id = id_of(ns, header);
        let final_path = self.block_file_path(ns, &header.key);
        let dir = final_path
            .parent()
            .unwrap_or(&self.blocks_dir)
            .to_path_buf();
        self.ensure_dir(&dir)?;
        // The name lock first (remove.rs: a removal of this key unlinks and
        // forgets under it, and may settle the pool); then, for a recycled
        // file, its new directory is noted before its rename out of
        // `recycle/`, under the settle lock: a settle's fsync of
        // `recycle/` then always finds it (and fsyncs it first).
        let _name = self.name_lock(id);
        let _settle = if recycled {
            let g = self
                .recycle_settle
                .read()
                .map_err(|_| lock_err("g3 recycle pool"))?;
            self.note_unsynced_dir(&dir);
            self.note_unsynced_dir(&self.recycle_dir);
            Some(g)
        } else {
            None
        };
        match self.fs.rename_noreplace(tmp, &final_path) {
            Ok(()) => {}
            Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {
                if self.is_indexed(id) {
                    let _ = self.fs.remove_file(tmp, Unlink::Temp);
                    return Ok(None);
                }
                tracing::warn!(%ns, key = %header.key, "g3: replacing an unindexed (orphan) block file");
                self.counters
                    .orphans_replaced
                    .fetch_add(1, Ordering::Relaxed);
                self.fs
                    .rename(tmp, &final_path)
                    .map_err(|e| Error::io("renaming into place", &final_path, e))?;
            }
            Err(e) => return Err(Error::io("renaming into place", &final_path, e)),
        }
        if recycled {
            self.counters
                .recycled_writes
                .fetch_add(1, Ordering::Relaxed);
        }
        Ok(Some(Placed { dir, recycled }))
    }

    pub(super) fn is_indexed(&self, id: u64) -> bool {
        self.mem.read().is_ok_and(|m| m.map.contains_key(&id))
    }

    /// The outcome of a put that joined another put's write of `id`
    /// (write.rs): present once that put published it; an error to retry
    /// when it released the id without storing it, or did not finish
    /// within `WRITER_WAIT_MS`.
    pub(super) fn await_writer(&self, id: u64) -> Result<PutOutcome> {
        let t = std::time::Instant::now();
        loop {
            if self.is_indexed(id) {
                return Ok(PutOutcome::AlreadyPresent);
            }
            let writing = self
                .writing
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .contains_key(&id);
            if !writing && self.is_indexed(id) {
                return Ok(PutOutcome::AlreadyPresent);
            }
            if !writing || t.elapsed() >= std::time::Duration::from_millis(WRITER_WAIT_MS) {
                return Err(Error::Timeout {
                    op: "an offload of the same block by another request (retry)",
                    timeout_ms: WRITER_WAIT_MS,
                });
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }

    /// The leader's half of a group commit: one fsync per distinct shard
    /// directory, then one (non-durable, see index.rs) redb transaction for
    /// every record of the group.
    pub(super) fn commit_group(
        &self,
        items: &[group::Pending],
    ) -> std::result::Result<(), group::Failure> {
        // Recycled writes (no `dir`) need no directory fsync (recycle.rs).
        let mut dirs: Vec<&Path> = items.iter().filter_map(|p| p.dir.as_deref()).collect();
        dirs.sort_unstable();
        dirs.dedup();
        if let Some((dir, e)) = self.sync_dirs_at_once(&dirs, SyncSite::CommitDirFsync) {
            self.poison(format!("fsync of directory {}: {e}", dir.display()));
            return Err(group::Failure::Dir {
                dir: dir.to_path_buf(),
                errno: e.raw_os_error(),
                msg: e.to_string(),
            });
        }
        let recs: Vec<(u64, &Record)> = items.iter().map(|p| (p.id, &p.rec)).collect();
        self.disk.put(&recs).map_err(|e| match e {
            Error::NoSpace { .. } => group::Failure::IndexNoSpace,
            e => group::Failure::Index(e.to_string()),
        })
    }

    /// fsyncs every directory of a group, all at once (up to
    /// `COMMIT_FSYNCS_IN_FLIGHT_MAX` threads), and returns the first
    /// failure. Each directory still gets its own fsync (what POSIX asks
    /// for a rename to be durable); issued together, a journaling
    /// filesystem (ext4's jbd2, XFS's log) serves them with one journal
    /// commit, where one after another each paid a commit or a cache flush
    /// of its own: a request's 8 blocks land in about 8 of the 256 shard
    /// directories, and those sequential fsyncs were the largest cost of
    /// an offload (docs/internals/g3.md, "Recycled block files").
    pub(super) fn sync_dirs_at_once<'d>(
        &self,
        dirs: &[&'d Path],
        site: SyncSite,
    ) -> Option<(&'d Path, std::io::Error)> {
        let sync = |d: &'d Path| self.fs.sync_dir(d, site).err().map(|e| (d, e));
        if dirs.len() <= 1 {
            return dirs.first().and_then(|d| sync(d));
        }
        let next = std::sync::atomic::AtomicUsize::new(0);
        let first: std::sync::Mutex<Option<(&'d Path, std::io::Error)>> =
            std::sync::Mutex::new(None);
        let run = || loop {
            let k = next.fetch_add(1, Ordering::Relaxed);
            let Some(d) = dirs.get(k) else { break };
            if let Some(f) = sync(d) {
                if let Ok(mut g) = first.lock() {
                    g.get_or_insert(f);
                }
            }
        };
        let workers = dirs.len().min(COMMIT_FSYNCS_IN_FLIGHT_MAX);
        let panics = crate::base::workers::fan_out(workers - 1, &run);
        let first = match first.into_inner() {
            Ok(f) => f,
            Err(_) => dirs.first().map(|d| {
                (
                    *d,
                    std::io::Error::other("a commit fsync lock was poisoned"),
                )
            }),
        };
        if first.is_none() && panics > 0 {
            // A directory's fsync outcome is unknown: fail the group
            // rather than ack on a guess.
            return dirs
                .first()
                .map(|d| (*d, std::io::Error::other("a commit fsync thread panicked")));
        }
        first
    }

    /// Creates `blocks/<ns>/<shard>` durably the first time it is needed.
    pub(super) fn ensure_dir(&self, dir: &Path) -> Result<()> {
        let mut known = self.known_dirs.lock().map_err(|_| lock_err("g3 dirs"))?;
        if known.contains(dir) {
            return Ok(());
        }
        let ns_dir = dir.parent().unwrap_or(&self.blocks_dir);
        for (d, parent, site) in [
            (ns_dir, &self.blocks_dir as &Path, SyncSite::NsDirFsync),
            (dir, ns_dir, SyncSite::ShardDirFsync),
        ] {
            match self.fs.create_dir(d) {
                Ok(()) => self.fs.sync_dir(parent, site).map_err(|e| {
                    self.poison(format!("fsync of directory {}: {e}", parent.display()));
                    Error::io("flushing directory", parent, e)
                })?,
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(Error::io("creating directory", d, e)),
            }
        }
        known.insert(dir.to_path_buf());
        // Both directories count against capacity from now on (dir_set.rs).
        self.counters
            .dir_bytes
            .store(known.bytes(), std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }
}
