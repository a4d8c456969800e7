//! Slots: blocks of up to `slot_file_bytes_max` live in shared slab files,
//! one per file length (`slots/<file pages>.slab`), each block in a slot
//! of exactly its file length at `slot * slot_bytes`. The slot holds the
//! block file's bytes unchanged (4096-byte header, padded payload), so
//! every verifier, the mount and G4 see the same block.
//!
//! Why (docs/BENCHMARKS.md, issue 41): a block of its own costs a create,
//! a data flush that is a journal commit, a rename and a directory fsync
//! per block; in a slot it costs one positioned O_DIRECT write and a share
//! of one `fdatasync` of the slab, shared by every writer of the window
//! (`Slab::flush`, group.rs `FlushWindow`), and a read is one positioned
//! read (no open, no path walk).
//!
//! Why slots of one length and not an append-only log: eviction frees
//! exactly the slot the policy chose (chains leaves first, pins, leases),
//! so there is no compaction and no segment whose live blocks must move;
//! engines write blocks of one length per model, so a class is one slab.
//!
//! A slot is live (an index entry names it), free (bytes allocated:
//! reused in place, no new extent, counted as pooled against capacity
//! like recycle.rs's pool), holed (no bytes: punched or never written),
//! taken (a write holds it) or settling (its block left; an erase or punch
//! is running before it becomes free). A slot a read is in flight on is
//! never handed to a writer: its release waits for the read's end.
//!
//! Durability: a block is acknowledged after its slot write and a flush
//! of the slab that began after it (the group commit then records it in
//! the index, like a file). A crash start reads every slot's header page
//! and adopts what verifies (slot_io.rs). An evicted block's slot keeps
//! its allocated bytes but its header page is zeroed, and a deleted
//! block's slot is punched, before either is reused: a kill -9 brings
//! neither back; a power cut before the next flush of the slab may (like
//! an unlink not yet durable); `close` flushes every slab before the
//! clean marker.
//!
//! Lock order: `Slots::inner` is a leaf (no other lock is taken under it).

use super::group::FlushWindow;
use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

/// File lengths held in slabs at once; a block of another length keeps a
/// file of its own (bounds the slab files, each with its free slots).
pub(super) const CLASSES_MAX: usize = 16;

/// Slots one slab holds at most (its offsets stay far below 2^63).
const SLOTS_PER_SLAB_MAX: u32 = u32::MAX - 1;

/// One slab file.
pub(super) struct Slab {
    /// Open read-write (O_DIRECT where the filesystem allows it).
    pub(super) file: File,
    pub(super) path: PathBuf,
    /// The file length of its blocks.
    pub(super) slot_bytes: u64,
    /// The flush shared by the writers of this slab.
    pub(super) flush: FlushWindow,
}

impl Slab {
    /// Byte offset of `slot`.
    pub(super) fn offset(&self, slot: u32) -> u64 {
        u64::from(slot) * self.slot_bytes
    }
}

/// What must happen to a released slot before it is free again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Release {
    /// Keep its bytes allocated, its header page zeroed (an eviction: the
    /// slot is reused in place, no new extent).
    Keep,
    /// Punch its bytes (a deletion, room for another length): the block
    /// cannot come back and the disk space returns.
    Punch,
}

struct Class {
    slab: Arc<Slab>,
    /// Slots below the end of the slab.
    len_slots: u32,
    free: Vec<u32>,
    holed: Vec<u32>,
}

#[derive(Default)]
struct Inner {
    /// By file pages (file length / 4096).
    classes: HashMap<u32, Class>,
    /// Bytes of free (allocated) slots.
    pooled_bytes: u64,
    /// Reads in flight, by (pages, slot).
    reading: HashMap<(u32, u32), u32>,
    /// Slots released while read: what to do once the last read ends.
    deferred: HashMap<(u32, u32), Release>,
}

impl Inner {
    /// What the caller must do to a released slot of class `pages`.
    fn settle(&self, pages: u32, slot: u32, how: Release) -> Option<Settle> {
        Some(Settle {
            slab: Arc::clone(&self.classes.get(&pages)?.slab),
            pages,
            slot,
            how,
        })
    }
}

/// The slab files and their slots (see the module doc).
pub(super) struct Slots {
    pub(super) dir: PathBuf,
    max_file_bytes: u64,
    inner: Mutex<Inner>,
}

/// A slot that must be punched (or is free to go) before it is settled.
pub(super) struct Settle {
    pub(super) slab: Arc<Slab>,
    pub(super) pages: u32,
    pub(super) slot: u32,
    pub(super) how: Release,
}

impl Slots {
    pub(super) fn new(dir: PathBuf, max_file_bytes: u64) -> Self {
        Slots {
            dir,
            max_file_bytes,
            inner: Mutex::new(Inner::default()),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic under this leaf lock leaves counts, never I/O half done.
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Whether a block file of `file_len` bytes goes to a slot.
    pub(super) fn fits(&self, file_len: u64) -> bool {
        file_len > 0 && file_len <= self.max_file_bytes
    }

    /// The path of the slab for `pages`.
    pub(super) fn path_of(&self, pages: u32) -> PathBuf {
        self.dir.join(format!("{pages}.slab"))
    }

    /// The slab of `pages`, if open.
    pub(super) fn slab(&self, pages: u32) -> Option<Arc<Slab>> {
        self.lock().classes.get(&pages).map(|c| Arc::clone(&c.slab))
    }

    /// Whether a slab for `pages` is open, or another may open.
    pub(super) fn has_room_for_class(&self, pages: u32) -> bool {
        let st = self.lock();
        st.classes.contains_key(&pages) || st.classes.len() < CLASSES_MAX
    }

    /// Registers an opened slab whose file holds `len_slots` slots, with
    /// the slots `live` names live and every other one free (its bytes may
    /// be allocated: counted as pooled until punched or reused).
    pub(super) fn add_class(&self, pages: u32, slab: Slab, len_slots: u32, live: &[u32]) {
        let mut st = self.lock();
        let mut is_live = vec![false; len_slots as usize];
        for &s in live {
            if let Some(x) = is_live.get_mut(s as usize) {
                *x = true;
            }
        }
        let free: Vec<u32> = (0..len_slots)
            .rev()
            .filter(|&s| !is_live[s as usize])
            .collect();
        st.pooled_bytes += free.len() as u64 * slab.slot_bytes;
        st.classes.insert(
            pages,
            Class {
                slab: Arc::new(slab),
                len_slots,
                free,
                holed: Vec::new(),
            },
        );
    }

    /// Takes a slot of class `pages` for a write: a free one first (its
    /// bytes leave the pool: `true`), else a holed one, else the slab
    /// grows by one. `None`: no such class, or the slab is full.
    pub(super) fn take(&self, pages: u32) -> Option<(Arc<Slab>, u32, bool)> {
        let mut guard = self.lock();
        let st = &mut *guard;
        let c = st.classes.get_mut(&pages)?;
        if let Some(s) = c.free.pop() {
            st.pooled_bytes = st.pooled_bytes.saturating_sub(c.slab.slot_bytes);
            return Some((Arc::clone(&c.slab), s, true));
        }
        if let Some(s) = c.holed.pop() {
            return Some((Arc::clone(&c.slab), s, false));
        }
        if c.len_slots >= SLOTS_PER_SLAB_MAX {
            return None;
        }
        c.len_slots += 1;
        Some((Arc::clone(&c.slab), c.len_slots - 1, false))
    }

    /// Gives back a slot `take` handed out that holds no block (a write
    /// that failed or was not needed). Its bytes may be anything: holed
    /// (a later write overwrites it whole; a crash start finds no block
    /// that verifies there, or an earlier one that does).
    pub(super) fn untake(&self, pages: u32, slot: u32) {
        if let Some(c) = self.lock().classes.get_mut(&pages) {
            c.holed.push(slot);
        }
    }

    /// A live slot's block left the index. Returns what the caller must
    /// do now ([`Slots::settled`] after it), or `None` when a read is in
    /// flight on it (the last reader's [`Slots::end_read`] returns it).
    pub(super) fn release(&self, pages: u32, slot: u32, how: Release) -> Option<Settle> {
        let mut st = self.lock();
        if st.reading.contains_key(&(pages, slot)) {
            st.deferred.insert((pages, slot), how);
            return None;
        }
        st.settle(pages, slot, how)
    }

    /// A released slot is free again (kept: pooled) or holed (punched).
    pub(super) fn settled(&self, s: &Settle, punched: bool) {
        let mut guard = self.lock();
        let st = &mut *guard;
        let Some(c) = st.classes.get_mut(&s.pages) else {
            return;
        };
        if punched {
            c.holed.push(s.slot);
        } else {
            c.free.push(s.slot);
            st.pooled_bytes += c.slab.slot_bytes;
        }
    }

    /// A read of `slot` begins (call it under the index read lock that
    /// found the slot, so no release can come between).
    pub(super) fn begin_read(&self, pages: u32, slot: u32) {
        *self.lock().reading.entry((pages, slot)).or_default() += 1;
    }

    /// A read of `slot` ended: the release it deferred, if it was the last.
    pub(super) fn end_read(&self, pages: u32, slot: u32) -> Option<Settle> {
        let mut st = self.lock();
        let n = st.reading.get_mut(&(pages, slot))?;
        *n -= 1;
        if *n > 0 {
            return None;
        }
        st.reading.remove(&(pages, slot));
        let how = st.deferred.remove(&(pages, slot))?;
        st.settle(pages, slot, how)
    }

    /// Bytes of free slots (allocated, counted against capacity).
    pub(super) fn pooled_bytes(&self) -> u64 {
        self.lock().pooled_bytes
    }

    /// Takes free slots, largest class first, until their bytes reach
    /// `bytes`, for the caller to punch (room for a write).
    pub(super) fn take_pooled(&self, bytes: u64) -> Vec<Settle> {
        let mut guard = self.lock();
        let st = &mut *guard;
        let mut pages: Vec<u32> = st.classes.keys().copied().collect();
        pages.sort_unstable_by(|a, b| b.cmp(a));
        let mut out = Vec::new();
        let mut got = 0u64;
        for p in pages {
            let Some(c) = st.classes.get_mut(&p) else {
                continue;
            };
            while got < bytes {
                let Some(slot) = c.free.pop() else { break };
                got += c.slab.slot_bytes;
                st.pooled_bytes = st.pooled_bytes.saturating_sub(c.slab.slot_bytes);
                out.push(Settle {
                    slab: Arc::clone(&c.slab),
                    pages: p,
                    slot,
                    how: Release::Punch,
                });
            }
        }
        out
    }

    /// Every open slab (close flushes them).
    pub(super) fn slabs(&self) -> Vec<Arc<Slab>> {
        self.lock()
            .classes
            .values()
            .map(|c| Arc::clone(&c.slab))
            .collect()
    }

    /// Slots in use and slab bytes, for stats: (live-or-taken slots, free
    /// slots, slab files).
    pub(super) fn counts(&self) -> (u64, u64, u64) {
        let st = self.lock();
        let mut used = 0u64;
        let mut free = 0u64;
        for c in st.classes.values() {
            let idle = (c.free.len() + c.holed.len()) as u64;
            used += u64::from(c.len_slots).saturating_sub(idle);
            free += c.free.len() as u64;
        }
        (used, free, st.classes.len() as u64)
    }
}

/// The file pages of a slab file's name (`<pages>.slab`).
pub(super) fn pages_of_name(name: &str) -> Option<u32> {
    let p: u32 = name.strip_suffix(".slab")?.parse().ok()?;
    (p >= 2 && name == format!("{p}.slab")).then_some(p)
}

/// Opens an existing slab file read-write.
pub(super) fn open_slab(path: &Path, direct: bool) -> std::io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut o = std::fs::OpenOptions::new();
    o.read(true).write(true);
    let mut flags = libc::O_CLOEXEC | libc::O_NOFOLLOW;
    if direct {
        flags |= libc::O_DIRECT;
    }
    o.custom_flags(flags).open(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slots_with_class(dir: &Path) -> Slots {
        let s = Slots::new(dir.to_path_buf(), 1 << 20);
        let path = dir.join("3.slab");
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .unwrap();
        s.add_class(
            3,
            Slab {
                file,
                path,
                slot_bytes: 3 * 4096,
                flush: FlushWindow::default(),
            },
            0,
            &[],
        );
        s
    }

    /// A slot released while a read of it runs is handed to no writer
    /// until that read ends: a reader never sees another block's bytes.
    #[test]
    fn a_slot_being_read_is_not_reused_until_the_read_ends() {
        let dir = tempfile::tempdir().unwrap();
        let s = slots_with_class(dir.path());
        let (_, a, pooled) = s.take(3).unwrap();
        assert!(!pooled);
        s.begin_read(3, a);
        assert!(s.release(3, a, Release::Keep).is_none(), "deferred");
        let (_, b, _) = s.take(3).unwrap();
        assert_ne!(a, b, "a slot being read went to a writer");
        let settle = s.end_read(3, a).expect("the deferred release");
        s.settled(&settle, false);
        assert_eq!(s.pooled_bytes(), 3 * 4096);
        let (_, c, pooled) = s.take(3).unwrap();
        assert_eq!((c, pooled), (a, true));
        assert_eq!(s.pooled_bytes(), 0);
    }

    #[test]
    fn pooled_slots_are_taken_for_punching_and_come_back_holed() {
        let dir = tempfile::tempdir().unwrap();
        let s = slots_with_class(dir.path());
        let taken: Vec<u32> = (0..4).map(|_| s.take(3).unwrap().1).collect();
        for &t in &taken {
            let st = s.release(3, t, Release::Keep).unwrap();
            s.settled(&st, false);
        }
        assert_eq!(s.pooled_bytes(), 4 * 3 * 4096);
        let punch = s.take_pooled(5 * 4096);
        assert_eq!(punch.len(), 2);
        for p in &punch {
            s.settled(p, true);
        }
        assert_eq!(s.pooled_bytes(), 2 * 3 * 4096);
        assert_eq!(s.counts(), (0, 2, 1));
        assert_eq!(pages_of_name("3.slab"), Some(3));
        assert_eq!(pages_of_name("03.slab"), None);
        assert_eq!(pages_of_name("1.slab"), None);
    }
}
