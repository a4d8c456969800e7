//! The store's I/O on slab slots (slots.rs holds their states): opening a
//! slab for a file length, a block written into its slot and flushed with
//! the slab's other writers, a slot read, a released slot punched or kept,
//! the slabs found at open (and, after a crash, every slot's header read
//! and what verifies adopted), and the flush of every slab at close.

use super::index::{digest, Entry, MemIndex, FLAG_SEEN, NO_SLOT};
use super::recover::RecoveryReport;
use super::seam::SyncSite;
use super::slots::{self, Release, Settle, Slab};
use super::verify::{ReadOutcome, Verifier};
use super::{lock_err, G3Store};
use crate::base::error::{Error, Result};
use kvtier_client::block::HEADER_BYTES;
use kvtier_client::{BlockHeader, BlockKey, Hints, NamespaceId};
use std::os::fd::AsRawFd;
use std::sync::Arc;

/// A slot a read holds (no writer gets it until dropped).
pub(super) struct SlotRead<'a> {
    store: &'a G3Store,
    pub(super) slab: Arc<Slab>,
    pub(super) pages: u32,
    pub(super) slot: u32,
}

impl Drop for SlotRead<'_> {
    fn drop(&mut self) {
        if let Some(s) = self.store.slots.end_read(self.pages, self.slot) {
            self.store.settle_slot(&s);
        }
    }
}

impl G3Store {
    /// The slab for blocks of `file_len` bytes, opened (its file created
    /// and its name made durable) on first use; `None` when blocks of this
    /// length keep their own files (too long, or too many lengths).
    pub(super) fn slab_for(&self, file_len: u64) -> Result<Option<u32>> {
        if !self.slots.fits(file_len) {
            return Ok(None);
        }
        let pages = (file_len / 4096) as u32;
        if self.slots.slab(pages).is_some() {
            return Ok(Some(pages));
        }
        let _one = self
            .slot_create
            .lock()
            .map_err(|_| lock_err("g3 slab creation"))?;
        if self.slots.slab(pages).is_some() {
            return Ok(Some(pages));
        }
        if !self.slots.has_room_for_class(pages) {
            return Ok(None);
        }
        let path = self.slots.path_of(pages);
        self.fs
            .create_new(&path, libc::O_CLOEXEC)
            .map_err(|e| Error::io("creating slab", &path, e))?;
        // The slab's name is durable before any block in it is acked.
        self.fs
            .sync_dir(&self.slots.dir, SyncSite::SlabDirFsync)
            .map_err(|e| Error::io("flushing directory", &self.slots.dir, e))?;
        let file = self
            .fs
            .open_slab(&path, self.direct_ok)
            .map_err(|e| Error::io("opening slab", &path, e))?;
        self.slots.add_class(
            pages,
            Slab {
                file,
                path,
                slot_bytes: file_len,
                flush: super::group::FlushWindow::default(),
            },
            0,
            &[],
        );
        Ok(Some(pages))
    }

    /// Writes a block into its slot (not durable until [`Self::flush_slab`]).
    pub(super) fn write_slot(
        &self,
        header: &BlockHeader,
        payload: &[u8],
        slab: &Slab,
        slot: u32,
    ) -> Result<()> {
        self.write_block_bytes(
            slab.file.as_raw_fd(),
            slab.offset(slot),
            &slab.path,
            header,
            payload,
            false,
        )
    }

    /// Makes every slot write completed so far durable: one flush of the
    /// slab that began after this call, shared with its other writers (the
    /// slab's `FlushWindow`). A failed flush poisons the store.
    pub(super) fn flush_slab(&self, slab: &Slab) -> Result<()> {
        let flushed = slab
            .flush
            .join(|| self.fs.sync_slab(&slab.file, SyncSite::SlabFdatasync));
        if let Err(e) = flushed {
            let err = Error::io("flushing slab", &slab.path, e);
            if !matches!(err, Error::NoSpace { .. }) {
                self.poison(format!("data flush of {}: {err}", slab.path.display()));
            }
            return Err(err);
        }
        Ok(())
    }

    /// The slot of a held entry, held for a read (under the index lock
    /// that found it, so no release comes between).
    pub(super) fn hold_slot(&self, e: &Entry) -> Option<SlotRead<'_>> {
        let slot = e.slotted()?;
        let slab = self.slots.slab(e.file_pages)?;
        self.slots.begin_read(e.file_pages, slot);
        Some(SlotRead {
            store: self,
            slab,
            pages: e.file_pages,
            slot,
        })
    }

    /// Reads a held slot into `dst` (its whole length), handing each piece
    /// to `on_ready`. Returns the bytes read.
    pub(super) fn read_slot(
        &self,
        held: &SlotRead<'_>,
        dst: &mut [u8],
        on_ready: super::engine::ReadyFn<'_>,
    ) -> std::io::Result<usize> {
        self.engine.read_file(
            held.slab.file.as_raw_fd(),
            held.slab.offset(held.slot),
            dst,
            on_ready,
        )
    }

    /// A slotted block left the index: its slot is kept for reuse (an
    /// eviction) or punched (a deletion), once no read holds it.
    pub(super) fn release_slot(&self, ns: &NamespaceId, key: &BlockKey, e: &Entry, how: Release) {
        let Some(slot) = e.slotted() else { return };
        self.fs.slot_released(&self.block_file_path(ns, key));
        if let Some(s) = self.slots.release(e.file_pages, slot, how) {
            self.settle_slot(&s);
        }
    }

    /// Punches a released slot when asked (a failed punch keeps its bytes:
    /// the slot is then free, pooled), else blanks its header page, and
    /// makes it free or holed. Blanked: a crash start (kill -9 too) finds
    /// no block there, so an evicted block never comes back unlinked from
    /// its chain; only a power cut before the next flush of the slab may
    /// undo the blanking (like an unlink not yet durable).
    pub(super) fn settle_slot(&self, s: &Settle) {
        if s.how == Release::Keep {
            self.blank_slot_header(s);
        }
        let punched = s.how == Release::Punch
            && match self
                .fs
                .punch(&s.slab.file, s.slab.offset(s.slot), s.slab.slot_bytes)
            {
                Ok(()) => true,
                Err(e) => {
                    tracing::warn!(slab = %s.slab.path.display(), slot = s.slot, error = %e,
                        "g3: cannot punch a slot; kept for reuse");
                    false
                }
            };
        self.slots.settled(s, punched);
    }

    /// Zeroes a released slot's header page (not flushed).
    fn blank_slot_header(&self, s: &Settle) {
        let mut bufs = self.pool.take(1);
        if bufs.is_empty() {
            return;
        }
        let r = self.engine.write_file(
            s.slab.file.as_raw_fd(),
            s.slab.offset(s.slot),
            HEADER_BYTES as u64,
            &mut bufs,
            &mut |_, b| b.fill(0),
        );
        self.pool.give(bufs);
        if let Err(e) = r {
            tracing::warn!(slab = %s.slab.path.display(), slot = s.slot, error = %e,
                "g3: cannot blank a released slot's header");
        }
    }

    /// Punches free slots worth `bytes` (room for a write: their bytes
    /// count against capacity). Returns the bytes freed.
    pub(super) fn drop_pooled_slots(&self, bytes: u64) -> u64 {
        let mut freed = 0;
        for s in self.slots.take_pooled(bytes) {
            self.settle_slot(&s);
            freed += s.slab.slot_bytes;
        }
        freed
    }

    /// Bytes of free slots (counted against capacity, like `recycle/`).
    pub(super) fn slot_pooled_bytes(&self) -> u64 {
        self.slots.pooled_bytes()
    }

    /// The header of a held block, checksum-verified: from its slot or its
    /// file (the uploader's routing facts). `None` when it is gone.
    pub fn read_header(&self, ns: &NamespaceId, key: &BlockKey) -> Option<BlockHeader> {
        let mut hb = super::engine::AlignedBuf::rounded(HEADER_BYTES).ok()?;
        let held = {
            let mem = self.mem.read().ok()?;
            let (_, e) = mem.get(ns, key)?;
            if e.slotted().is_some() {
                Some(self.hold_slot(e)?)
            } else {
                None
            }
        };
        match held {
            Some(h) => {
                let got = self
                    .read_slot(&h, &mut hb.as_mut_slice()[..HEADER_BYTES], &mut |_| {})
                    .ok()?;
                (got == HEADER_BYTES).then_some(())?;
            }
            None => {
                use std::io::Read;
                let mut f = std::fs::File::open(self.block_file_path(ns, key)).ok()?;
                f.read_exact(&mut hb.as_mut_slice()[..HEADER_BYTES]).ok()?;
            }
        }
        BlockHeader::decode(&hb.as_slice()[..HEADER_BYTES])
            .ok()
            .filter(|h| h.key == *key && h.namespace_id() == *ns)
    }

    /// Flushes every slab (close, before the clean marker: the punches of
    /// deleted blocks' slots are durable, so none comes back).
    pub(super) fn sync_slabs(&self) -> Result<()> {
        for s in self.slots.slabs() {
            self.fs
                .sync_slab(&s.file, SyncSite::SlabCloseSync)
                .map_err(|e| Error::io("flushing slab", &s.path, e))?;
        }
        Ok(())
    }

    /// At open: opens every slab under `slots/` and registers it with the
    /// slots `mem` holds live in it. After a crash (`scan`), first reads
    /// every slot's header: a slot holding the block its entry names marks
    /// the entry seen; any other valid block (not held elsewhere) is read
    /// whole, verified and adopted; everything else is free. Entries whose
    /// slot holds something else stay unseen (the walk drops them).
    pub(super) fn open_slabs(
        &self,
        mem: &mut MemIndex,
        order: &mut Vec<(u32, u64, Hints)>,
        scan: bool,
        rep: &mut RecoveryReport,
    ) -> Result<()> {
        let names = match std::fs::read_dir(&self.slots.dir) {
            Ok(rd) => rd,
            Err(e) => return Err(Error::io("listing", &self.slots.dir, e)),
        };
        let mut found: Vec<(u32, std::path::PathBuf)> = Vec::new();
        for e in names.flatten() {
            let path = e.path();
            let is_file = e.file_type().map(|t| t.is_file()).unwrap_or(false);
            match e.file_name().to_str().and_then(slots::pages_of_name) {
                Some(p) if is_file => found.push((p, path)),
                _ => self.set_aside(&path, "not a slab file", rep),
            }
        }
        found.sort_unstable();
        for (pages, path) in found {
            let file = self
                .fs
                .open_slab(&path, self.direct_ok)
                .map_err(|e| Error::io("opening slab", &path, e))?;
            let size = file
                .metadata()
                .map_err(|e| Error::io("stat", &path, e))?
                .len();
            let slot_bytes = u64::from(pages) * 4096;
            // A slot past the last whole one is a torn extension: ignored
            // (the next write of that slot overwrites it).
            let len_slots = u32::try_from(size / slot_bytes).unwrap_or(u32::MAX - 1);
            let slab = Slab {
                file,
                path,
                slot_bytes,
                flush: super::group::FlushWindow::default(),
            };
            if scan {
                for slot in 0..len_slots {
                    self.scan_slot(&slab, pages, slot, mem, order, rep)?;
                }
            }
            let live: Vec<u32> = mem
                .map
                .values()
                .filter(|e| e.file_pages == pages && e.slot != NO_SLOT)
                .filter(|e| !scan || e.flags & FLAG_SEEN != 0)
                .map(|e| e.slot)
                .collect();
            self.slots.add_class(pages, slab, len_slots, &live);
        }
        Ok(())
    }

    /// One slot of a crash start (see [`G3Store::open_slabs`]).
    fn scan_slot(
        &self,
        slab: &Slab,
        pages: u32,
        slot: u32,
        mem: &mut MemIndex,
        order: &mut Vec<(u32, u64, Hints)>,
        rep: &mut RecoveryReport,
    ) -> Result<()> {
        let fd = slab.file.as_raw_fd();
        let mut head = super::engine::AlignedBuf::rounded(HEADER_BYTES)
            .map_err(|e| Error::io("allocating", "g3 slab scan", e))?;
        let got = self
            .engine
            .read_file(fd, slab.offset(slot), head.as_mut_slice(), &mut |_| {})
            .map_err(|e| Error::io("reading", &slab.path, e))?;
        if got < HEADER_BYTES {
            return Ok(());
        }
        let Ok(h) = BlockHeader::decode(&head.as_slice()[..HEADER_BYTES]) else {
            return Ok(());
        };
        if h.file_len() != slab.slot_bytes {
            return Ok(());
        }
        let ns = h.namespace_id();
        let (id, check) = digest(&ns, &h.key);
        let mut stale_entry = false;
        if let Some(e) = mem.map.get_mut(&id) {
            if e.check != check {
                return Ok(()); // another name's entry: left as is
            }
            if e.slot == slot && e.file_pages == pages {
                e.flags |= FLAG_SEEN;
                return Ok(());
            }
            if e.flags & FLAG_SEEN != 0 {
                return Ok(()); // a second copy: this slot is free
            }
            stale_entry = true;
        }
        // Not what the index says is here: verified in full first.
        let mut buf = super::engine::AlignedBuf::rounded(slab.slot_bytes as usize)
            .map_err(|e| Error::io("allocating", "g3 slab scan", e))?;
        let mut v = Verifier::new(&ns, &h.key, slab.slot_bytes);
        let got = self
            .engine
            .read_file(fd, slab.offset(slot), buf.as_mut_slice(), &mut |p| {
                v.feed(p)
            })
            .map_err(|e| Error::io("reading", &slab.path, e))?;
        let ReadOutcome::Ok(h) = v.finish(got as u64) else {
            rep.slots_torn += 1;
            return Ok(());
        };
        if stale_entry {
            if let Some(e) = mem.map.get_mut(&id) {
                e.slot = slot;
                e.flags |= FLAG_SEEN;
            }
            if let Some(mut r) = self.disk.get(id)? {
                r.slot = Some(slot);
                self.disk.put(&[(id, &r)])?;
            }
            return Ok(());
        }
        let mut r = super::recover::adopted_record(ns, h.key, &h);
        r.slot = Some(slot);
        self.disk.put(&[(id, &r)])?;
        let mut en = super::recover::entry_of(&r, check);
        en.flags |= FLAG_SEEN;
        order.push((r.last_access_s, id, Hints::default()));
        mem.insert(ns, id, en);
        rep.adopted += 1;
        Ok(())
    }

    /// Copies a slotted block's bytes into `quarantine/` (the slot itself
    /// is punched when the block leaves the index).
    pub(super) fn quarantine_slot_copy(&self, held: SlotRead<'_>, name: &str) {
        let len = held.slab.slot_bytes as usize;
        let Ok(mut buf) = super::engine::AlignedBuf::rounded(len) else {
            return;
        };
        let got = self
            .read_slot(&held, &mut buf.as_mut_slice()[..len], &mut |_| {})
            .unwrap_or(0);
        drop(held);
        self.counters
            .quarantined
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let to = self
            .quarantine_dir
            .join(format!("{name}.{}", super::quarantine::now_ms()));
        if let Err(e) =
            self.fs
                .write_synced(&to, &buf.as_slice()[..got], SyncSite::QuarantineCopySync)
        {
            tracing::warn!(path = %to.display(), error = %e, "g3: cannot copy a slot into quarantine/");
        }
        self.trim_quarantine();
    }
}
