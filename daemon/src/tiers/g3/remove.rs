//! Taking a block out of the tier: `delete_block` (on request) and
//! `remove_block` (eviction too) unlink the file; `forget` drops it from
//! memory, policy and redb, refusing to touch a colliding name, and takes
//! the descendants that the removal left unreachable along (chains.rs).

use super::index::digest;
use super::slots::Release;
use super::{lock_err, G3Event, G3Store, RemoveReason};
use crate::base::error::{Error, Result};
use kvtier_client::{BlockKey, NamespaceId};

/// Empty directories removed at most per reclaimer pass.
const EMPTY_DIRS_PER_PASS: usize = 64;

/// Stripes of [`G3Store::name_lock`].
pub(super) const NAME_LOCKS: usize = 64;

impl G3Store {
    /// Deletes a block (leases and pins do not protect against this);
    /// `false` when absent.
    pub fn delete_block(&self, ns: &NamespaceId, key: &BlockKey) -> Result<bool> {
        self.remove_block(ns, key, RemoveReason::Deleted, false)
    }

    /// Evicts a block on request (leases and pins do not protect against
    /// this either): [`G3Store::delete_block`] (the same `Deleted` event,
    /// as before), but its file may be kept in the recycle pool for a
    /// later offload of the same size to overwrite (recycle.rs); `false`
    /// when absent.
    pub fn evict_block(&self, ns: &NamespaceId, key: &BlockKey) -> Result<bool> {
        self.remove_block(ns, key, RemoveReason::Deleted, true)
    }

    /// `retire`: the file may go to the recycle pool rather than be
    /// unlinked (not when the room is needed now: pooled bytes count
    /// against capacity, so retiring frees nothing).
    pub(super) fn remove_block(
        &self,
        ns: &NamespaceId,
        key: &BlockKey,
        reason: RemoveReason,
        retire: bool,
    ) -> Result<bool> {
        self.remove_block_as(ns, key, Some(reason), retire)
    }

    /// [`G3Store::remove_block`]; `reason` `None`: no `Removed` event (a
    /// block never announced as stored, `take_back`).
    ///
    /// The name and the entry go together under the name lock: a put of
    /// the same key renames into place under it too, and a read that found
    /// the file gone forgets the entry under it only while no file is
    /// back (`forget_after`), so none of them sees the name without the
    /// entry or the entry without the name.
    fn remove_block_as(
        &self,
        ns: &NamespaceId,
        key: &BlockKey,
        reason: Option<RemoveReason>,
        retire: bool,
    ) -> Result<bool> {
        let (id, check) = digest(ns, key);
        let how = if retire {
            Release::Keep
        } else {
            Release::Punch
        };
        // (forgotten, unlinked)
        let (forgotten, unlinked) = {
            let _name = self.name_lock(id);
            let Some((slot, len)) = self.entry_of(id, check)? else {
                return Ok(false);
            };
            if slot.is_some() {
                // No file: the slot is released as the entry leaves.
                (self.forget_one(ns, key, id, how)?, false)
            } else {
                let path = self.block_file_path(ns, key);
                let removed = if retire {
                    self.retire_or_unlink(&path, len)
                } else {
                    match self.fs.remove_file(&path, super::seam::Unlink::Block) {
                        Ok(()) => Ok(true),
                        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
                        Err(e) => Err(e),
                    }
                };
                let unlinked = match removed {
                    Ok(true) => {
                        self.note_removal(&path);
                        true
                    }
                    Ok(false) => false,
                    Err(e) => return Err(Error::io("removing", &path, e)),
                };
                (self.forget_one(ns, key, id, how)?, unlinked)
            }
        };
        if !forgotten {
            // A reader (the uploader, an onboard) that found the file gone
            // dropped the entry (with its own Removed event) first: the
            // block is still ours to report removed, not absent.
            return Ok(unlinked);
        }
        self.remove_descendants(id);
        if let Some(reason) = reason {
            self.emit(G3Event::Removed {
                ns: *ns,
                key: *key,
                reason,
            });
        }
        Ok(true)
    }

    /// The slot (`None`: a file of its own) and file length of the entry
    /// `id` holds for the name whose check digest is `check`.
    fn entry_of(&self, id: u64, check: u64) -> Result<Option<(Option<u32>, u64)>> {
        Ok(self
            .mem
            .read()
            .map_err(|_| lock_err("g3 index"))?
            .map
            .get(&id)
            .filter(|e| e.check == check)
            .map(|e| (e.slotted(), e.file_len())))
    }

    /// The lock of the name of block `id` (one of [`NAME_LOCKS`] stripes):
    /// see [`G3Store::remove_block_as`]. Taken before any other G3 lock.
    pub(super) fn name_lock(&self, id: u64) -> std::sync::MutexGuard<'_, ()> {
        let m = &self.name_locks[(id % NAME_LOCKS as u64) as usize];
        m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Remembers the directory of an unlinked block file (see
    /// `unsynced_removals`), and that it may be empty now.
    pub(super) fn note_removal(&self, path: &std::path::Path) {
        if let (Some(d), Ok(mut set)) = (path.parent(), self.unsynced_removals.lock()) {
            set.insert(d.to_path_buf());
            if d.starts_with(&self.blocks_dir) {
                if let Ok(mut e) = self.maybe_empty.lock() {
                    e.insert(d.to_path_buf());
                }
            }
        }
    }

    /// At open: every empty shard directory, then every empty namespace
    /// directory, goes (rmdir fails on one that holds anything). Earlier
    /// runs' unlinks are durable by now (close, or recovery's walk), so
    /// one fsync of `blocks/` at the end; an empty directory a power cut
    /// brings back is removed at the next open.
    ///
    /// The shard directories that stay are recorded as known, so that
    /// they count against capacity after a clean open too (which walks no
    /// block file).
    pub(super) fn remove_empty_dirs_at_open(&self) -> u64 {
        let mut n = 0u64;
        let Ok(namespaces) = std::fs::read_dir(&self.blocks_dir) else {
            return 0;
        };
        let mut kept = Vec::new();
        for ns in namespaces.flatten() {
            if !ns.file_type().is_ok_and(|t| t.is_dir()) {
                continue;
            }
            let ns_dir = ns.path();
            if let Ok(shards) = std::fs::read_dir(&ns_dir) {
                for sh in shards.flatten() {
                    if !sh.file_type().is_ok_and(|t| t.is_dir()) {
                        continue;
                    }
                    if self.fs.remove_dir(&sh.path()).is_err() {
                        kept.push(sh.path());
                    } else {
                        // Recovery's walk recorded it as made: forget it,
                        // or the next put would skip creating it and its
                        // rename would find no directory (a crash restart
                        // that quarantined a shard's only files).
                        self.with_dirs(|k| k.remove(&sh.path()));
                        n += 1;
                    }
                }
            }
            if self.fs.remove_dir(&ns_dir).is_ok() {
                n += 1;
            }
        }
        self.with_dirs(|k| kept.into_iter().for_each(|d| k.insert(d)));
        if n > 0 {
            let _ = self
                .fs
                .sync_dir(&self.blocks_dir, super::seam::SyncSite::NsDirFsync);
            self.counters
                .dirs_removed
                .fetch_add(n, std::sync::atomic::Ordering::Relaxed);
        }
        n
    }

    /// Removes the shard directories removals left empty, and their
    /// namespace directories once empty too: each is space the filesystem
    /// keeps (4 KiB on ext4) for nothing, and a namespace per tenant salt
    /// or adapter leaves two. Under the write gate, so that no put is
    /// between creating its directory and renaming into it; at most
    /// [`EMPTY_DIRS_PER_PASS`] directories a pass (the reclaimer's, every
    /// second). Each removal is made durable as it goes: the shard's
    /// unlinks first (close's fsync would not find it), its creation in the
    /// namespace directory, then the removal itself.
    pub(super) fn remove_empty_dirs(&self) {
        use super::seam::SyncSite;
        let dirs: Vec<std::path::PathBuf> = match self.maybe_empty.lock() {
            Ok(mut e) => {
                let take: Vec<_> = e.iter().take(EMPTY_DIRS_PER_PASS).cloned().collect();
                for d in &take {
                    e.remove(d);
                }
                take
            }
            Err(_) => return,
        };
        if dirs.is_empty() {
            return;
        }
        let Ok(_gate) = self.write_gate.write() else {
            return;
        };
        if self.closed.load(std::sync::atomic::Ordering::Acquire) {
            return;
        }
        for shard in dirs {
            let Some(ns_dir) = shard.parent().filter(|p| *p != self.blocks_dir) else {
                continue;
            };
            let emptied = self
                .fs
                .sync_dir(&shard, SyncSite::CloseRemovalsFsync)
                .and_then(|()| self.fs.sync_dir(ns_dir, SyncSite::ShardDirFsync))
                .and_then(|()| self.fs.remove_dir(&shard))
                .and_then(|()| self.fs.sync_dir(ns_dir, SyncSite::ShardDirFsync));
            if emptied.is_err() {
                // Not empty (a block came back), gone, or not removable:
                // left as it is.
                continue;
            }
            self.with_dirs(|k| k.remove(&shard));
            if let Ok(mut u) = self.unsynced_removals.lock() {
                u.remove(&shard);
            }
            self.counters
                .dirs_removed
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let ns_gone = self
                .fs
                .sync_dir(&self.blocks_dir, SyncSite::NsDirFsync)
                .and_then(|()| self.fs.remove_dir(ns_dir))
                .and_then(|()| self.fs.sync_dir(&self.blocks_dir, SyncSite::NsDirFsync));
            if ns_gone.is_ok() {
                self.counters
                    .dirs_removed
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
        }
    }

    /// Remembers a directory whose entries changed without an fsync (a
    /// recycled write's rename, recycle.rs): made durable with the
    /// removals at close.
    pub(super) fn note_unsynced_dir(&self, dir: &std::path::Path) {
        if let Ok(mut set) = self.unsynced_removals.lock() {
            set.insert(dir.to_path_buf());
        }
    }

    /// Makes every unlink so far durable (close, before the marker).
    pub(super) fn sync_removals(&self) -> Result<()> {
        let mut dirs: Vec<std::path::PathBuf> = self
            .unsynced_removals
            .lock()
            .map_err(|_| lock_err("g3 removals"))?
            .drain()
            .collect();
        // `recycle/` last: its fsync makes the removal of names recycled
        // writes renamed into `blocks/` durable, which must not come before
        // their new names (recycle.rs).
        dirs.sort_by_key(|d| *d == self.recycle_dir);
        for d in dirs {
            match self
                .fs
                .sync_dir(&d, super::seam::SyncSite::CloseRemovalsFsync)
            {
                Ok(()) => {}
                // A shard directory removed behind our back: nothing to sync.
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(Error::io("flushing directory", &d, e)),
            }
        }
        Ok(())
    }

    /// Removes the held descendants of a block that left (a forced
    /// removal: delete, `kvtier evict`, corruption, a vanished file;
    /// eviction takes only leaves): no lookup can reach them any more, so
    /// they would only take room. Children before their parents, each with
    /// its `Removed` event. Leases and pins do not keep them (as for the
    /// removal itself).
    fn remove_descendants(&self, id: u64) {
        let ids = match self.mem.read() {
            Ok(m) => m.chains.descendants(id, m.map.len()),
            Err(_) => return,
        };
        self.remove_unreachable(&ids);
    }

    /// Removes blocks that no lookup can reach (their parent is gone), and
    /// their descendants, each with its `Removed` event.
    pub(super) fn remove_unreachable(&self, ids: &[u64]) {
        for &id in ids {
            let Ok(Some(rec)) = self.disk.get(id) else {
                continue;
            };
            match self.remove_block(&rec.ns, &rec.key, RemoveReason::Deleted, false) {
                Ok(true) => {
                    self.counters
                        .unreachable_removed
                        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
                Ok(false) => {}
                Err(e) => {
                    tracing::warn!(key = %rec.key, error = %e, "g3: cannot remove a block whose parent is gone");
                }
            }
        }
    }

    /// Takes back blocks of a batch that were written but found unreachable
    /// when published (an earlier block of their chain failed, or their
    /// parent was removed by force meanwhile): answered `ParentAbsent` and
    /// never announced, so no `Removed` event either. `ids` in batch order
    /// (a parent before its child): taken last first, so none goes as
    /// another's descendant (which would announce it).
    pub(super) fn take_back(&self, ids: &[u64]) {
        for &id in ids.iter().rev() {
            let Ok(Some(rec)) = self.disk.get(id) else {
                continue;
            };
            if let Err(e) = self.remove_block_as(&rec.ns, &rec.key, None, false) {
                tracing::warn!(key = %rec.key, error = %e, "g3: cannot take back a block whose parent is gone");
            }
        }
    }

    /// Drops a block whose file vanished under a read from memory, policy
    /// and redb, and its descendants with it (`remove_descendants`).
    pub(super) fn forget(&self, ns: &NamespaceId, key: &BlockKey, id: u64) -> Result<bool> {
        self.forget_after(ns, key, id, true, || {})
    }

    /// Runs `first` (a quarantine moving the file away) and drops the
    /// block from memory, policy and redb, both under the name lock, and
    /// then its descendants. `vanished`: the file was found gone, so a
    /// file entry whose name holds a file again by then (a put of the same
    /// key renamed it into place meanwhile) is kept: that put's block is
    /// the one indexed.
    pub(super) fn forget_after(
        &self,
        ns: &NamespaceId,
        key: &BlockKey,
        id: u64,
        vanished: bool,
        first: impl FnOnce(),
    ) -> Result<bool> {
        let forgotten = {
            let _name = self.name_lock(id);
            first();
            let (_, check) = digest(ns, key);
            let file_entry = self.entry_of(id, check)?.map(|(slot, _)| slot.is_none());
            if vanished
                && file_entry == Some(true)
                && std::fs::symlink_metadata(self.block_file_path(ns, key)).is_ok()
            {
                return Ok(false);
            }
            self.forget_one(ns, key, id, Release::Punch)?
        };
        if forgotten {
            self.remove_descendants(id);
        }
        Ok(forgotten)
    }

    /// Drops one entry (memory, policy, redb; a slot released), under the
    /// caller's name lock. The record goes only if it is the removed
    /// entry's (the same slot, or none): once the entry left memory a put
    /// of this key may plan, write a slot and commit its own record before
    /// this removal reaches redb, and that record must stay (a file put
    /// renames under the name lock, so it cannot get that far). Removing
    /// the record first instead let an eviction find an entry without a
    /// record and drop it without freeing its slot (found by the
    /// power-loss harness).
    fn forget_one(&self, ns: &NamespaceId, key: &BlockKey, id: u64, how: Release) -> Result<bool> {
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
            e
        };
        let slot = removed.as_ref().and_then(super::index::Entry::slotted);
        // A failed removal is still made in memory (the block is gone):
        // the index writes it with its next mend (index.rs).
        let on_disk = self
            .disk
            .remove_if(id, |r| r.ns == *ns && r.key == *key && r.slot == slot);
        // After the entry left memory: a read that found the slot holds it
        // (slots.rs), so the release waits for that read's end.
        if let Some(e) = &removed {
            self.release_slot(ns, key, e, how);
        }
        on_disk?;
        Ok(removed.is_some())
    }
}
