//! The onboard (read) path: `read_into` reads a block file and verifies it
//! as the chunks arrive, in the daemon's own bounce buffer, and copies it to
//! the caller only once verified ([`super::verify::Verifier`]); a vanished file is
//! forgotten, a corrupt one quarantined, both a miss. `open_for_read` hands
//! an unverified fd to readers that verify themselves.

use super::index::Entry;
use super::slot_io::SlotRead;
use super::verify::{ReadOutcome, Verifier};
use super::{lock_err, now_s, BlockInfo, G3Event, G3Store, RemoveReason};
use crate::base::error::{Error, Result};
use crate::base::tier::{Lookup, MissReason};
use kvtier_client::block::ALIGN_BYTES;
use kvtier_client::{BlockHeader, BlockKey, NamespaceId};
use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// Where a held block's bytes are, as the index lock that found it saw
/// them (a slot is held for the read: no writer gets it meanwhile).
pub(super) enum Where<'a> {
    /// A file of its own.
    File,
    /// A slot of a slab (slots.rs).
    Slot(SlotRead<'a>),
    /// Slotted, but its slab is not open (gone behind the store's back).
    Gone,
}

impl<'a> Where<'a> {
    /// Call under the index lock that found `e`.
    pub(super) fn of(store: &'a G3Store, e: &Entry) -> Self {
        if e.slotted().is_none() {
            return Where::File;
        }
        store.hold_slot(e).map_or(Where::Gone, Where::Slot)
    }
}

/// Who checks a read block's payload against its checksum.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum PayloadCheck {
    /// The store, in its own memory, before any byte reaches the caller.
    Store,
    /// The reader, on the bytes it received ([`G3Store::read_into_for_verifier`]).
    Reader,
}

impl G3Store {
    /// Reads a whole block file into `dst` (`dst.len()` at least the file
    /// length, see [`G3Store::stat`]); the payload lands at offset 4096.
    /// The header, length, padding and payload checksum are verified as
    /// the chunks arrive, in the daemon's own buffer, before the bytes are
    /// copied to `dst` and `Hit` is returned (O_DIRECT where the filesystem
    /// allows it). A block that fails verification is quarantined and
    /// reads as `Miss(Corrupt)`; `dst` is then left untouched.
    pub fn read_into(
        &self,
        ns: &NamespaceId,
        key: &BlockKey,
        dst: &mut [u8],
    ) -> Result<Lookup<BlockHeader>> {
        self.read_into_checked(ns, key, dst, PayloadCheck::Store)
    }

    /// [`G3Store::read_into`] for a reader that checks the payload against
    /// the header's checksum itself, on the bytes it received (a client
    /// onboarding into its shared region: kvtier-client always does, and
    /// reports a mismatch with `OP_REPORT_CORRUPT`, which re-verifies and
    /// quarantines here). The file is read straight into `dst` when `dst`
    /// suits O_DIRECT (no bounce buffer, no copy) and only its header and
    /// length are checked here, so each byte is hashed once, by the side
    /// that uses it. Whatever fails that check is settled by the verifying
    /// read in the daemon's own memory: `dst` may be memory the client
    /// writes, so nothing seen there quarantines a block by itself.
    pub fn read_into_for_verifier(
        &self,
        ns: &NamespaceId,
        key: &BlockKey,
        dst: &mut [u8],
    ) -> Result<Lookup<BlockHeader>> {
        self.read_into_checked(ns, key, dst, PayloadCheck::Reader)
    }

    fn read_into_checked(
        &self,
        ns: &NamespaceId,
        key: &BlockKey,
        dst: &mut [u8],
        check: PayloadCheck,
    ) -> Result<Lookup<BlockHeader>> {
        let found = {
            let mem = self.mem.read().map_err(|_| lock_err("g3 index"))?;
            mem.get(ns, key)
                .map(|(id, e)| (id, e.file_len(), Where::of(self, e)))
        };
        let Some((id, file_len, at)) = found else {
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
        let read = match check {
            PayloadCheck::Reader => self.read_for_verifier(ns, key, &at, file_len, dst)?,
            PayloadCheck::Store => None,
        };
        let read = match read {
            Some(r) => r,
            None => self.read_verified(ns, key, &at, file_len, Some(dst))?,
        };
        drop(at);
        match read {
            ReadOutcome::Ok(h) => {
                // In request order when the server reads a request's
                // blocks at once (access_order.rs): deferred until the
                // earlier reads of the request are done, never waited for.
                super::access_order::touch_in_turn(self.count_hit(id));
                Ok(Lookup::Hit(h))
            }
            other => {
                self.counters.misses.fetch_add(1, Ordering::Relaxed);
                self.settle_failed_read(ns, key, id, other)
            }
        }
    }

    /// Counts a served read of block `id` (the store's hits, the entry's
    /// hits and last access) and returns its eviction-policy touch, for
    /// the caller to run in request order (access_order.rs).
    pub(super) fn count_hit(&self, id: u64) -> super::access_order::Touch {
        self.counters.hits.fetch_add(1, Ordering::Relaxed);
        if let Ok(mem) = self.mem.read() {
            if let Some(e) = mem.map.get(&id) {
                e.hits.fetch_add(1, Ordering::Relaxed);
                e.last_access_s.store(now_s(), Ordering::Relaxed);
            }
        }
        let policy = Arc::clone(&self.policy);
        Box::new(move || {
            if let Ok(mut p) = policy.lock() {
                p.on_access(id);
            }
        })
    }

    /// Re-reads and verifies a block's file without serving it: the
    /// background scrub and a client's corruption report (node/repair.rs).
    /// No hit is counted and no access stamped (eviction order is the
    /// clients'). A copy that fails is quarantined (a Removed event;
    /// lookups stop reporting it) and reads `Miss(Corrupt)`; a vanished
    /// one is forgotten (`Miss(Absent)`).
    pub fn scrub_block(&self, ns: &NamespaceId, key: &BlockKey) -> Result<Lookup<()>> {
        let found = {
            let mem = self.mem.read().map_err(|_| lock_err("g3 index"))?;
            mem.get(ns, key)
                .map(|(id, e)| (id, e.file_len(), Where::of(self, e)))
        };
        let Some((id, file_len, at)) = found else {
            return Ok(Lookup::Miss(MissReason::Absent));
        };
        let read = self.read_verified(ns, key, &at, file_len, None)?;
        drop(at);
        match read {
            ReadOutcome::Ok(_) => Ok(Lookup::Hit(())),
            other => self.settle_failed_read(ns, key, id, other),
        }
    }

    /// A read that did not verify: a vanished file is forgotten, a corrupt
    /// one quarantined; both a miss.
    fn settle_failed_read<T>(
        &self,
        ns: &NamespaceId,
        key: &BlockKey,
        id: u64,
        outcome: ReadOutcome,
    ) -> Result<Lookup<T>> {
        match outcome {
            ReadOutcome::Vanished | ReadOutcome::Ok(_) => {
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
                self.quarantine(ns, key, id, &why);
                Ok(Lookup::Miss(MissReason::Corrupt))
            }
        }
    }

    /// Reads and verifies the file (`want` bytes, as the index says) in
    /// the daemon's own (aligned, bounce) memory and copies it to `dst`
    /// only once it verified: `dst` may be a client's shared memory, and a
    /// client rewriting it mid-read must never get a good block
    /// quarantined. `None`: verify only.
    fn read_verified(
        &self,
        ns: &NamespaceId,
        key: &BlockKey,
        at: &Where<'_>,
        want: u64,
        dst: Option<&mut [u8]>,
    ) -> Result<ReadOutcome> {
        let len = want as usize;
        let path;
        let file;
        let (fd, off) = match at {
            Where::Slot(held) => {
                path = held.slab.path.clone();
                (held.slab.file.as_raw_fd(), held.slab.offset(held.slot))
            }
            Where::Gone => return Ok(ReadOutcome::Vanished),
            Where::File => {
                path = self.block_file_path(ns, key);
                file = match self.open_block(&path, self.direct_ok) {
                    Ok(f) => f,
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                        return Ok(ReadOutcome::Vanished)
                    }
                    Err(e) => return Err(Error::io("opening", &path, e)),
                };
                let size = file
                    .metadata()
                    .map_err(|e| Error::io("stat", &path, e))?
                    .len();
                if size != want {
                    return Ok(ReadOutcome::Corrupt(format!(
                        "file is {size} bytes, index says {want}"
                    )));
                }
                (file.as_raw_fd(), 0)
            }
        };
        let mut own = self
            .bounce
            .take(len)
            .map_err(|e| Error::io("allocating", "g3 read buffer", e))?;
        let mut v = Verifier::new(ns, key, want);
        let got = self
            .engine
            .read_file(fd, off, &mut own.as_mut_slice()[..len], &mut |piece| {
                v.feed(piece)
            })
            .map_err(|e| Error::io("reading", &path, e));
        let outcome = got.map(|got| v.finish(got as u64));
        if let (Ok(ReadOutcome::Ok(_)), Some(dst)) = (&outcome, dst) {
            dst.copy_from_slice(&own.as_slice()[..len]);
        }
        self.bounce.give(own);
        outcome
    }

    /// The read of [`G3Store::read_into_for_verifier`]: straight into
    /// `dst` (O_DIRECT where the filesystem takes it and `dst` is aligned
    /// for it), the header and length checked. `None` when that read did
    /// not check out: the caller then makes the verifying read, which
    /// decides in the daemon's own memory.
    fn read_for_verifier(
        &self,
        ns: &NamespaceId,
        key: &BlockKey,
        at: &Where<'_>,
        want: u64,
        dst: &mut [u8],
    ) -> Result<Option<ReadOutcome>> {
        let aligned = (dst.as_ptr() as usize).is_multiple_of(ALIGN_BYTES)
            && dst.len().is_multiple_of(ALIGN_BYTES);
        match at {
            Where::Gone => return Ok(Some(ReadOutcome::Vanished)),
            // The slab is O_DIRECT: an unaligned destination goes through
            // the verifying read's bounce buffer.
            Where::Slot(_) if self.direct_ok && !aligned => return Ok(None),
            Where::Slot(held) => {
                let mut v = Verifier::header_only(ns, key, want);
                return Ok(
                    match self.read_slot(held, dst, &mut |piece| v.feed(piece)) {
                        Ok(got) => match v.finish(got as u64) {
                            ok @ ReadOutcome::Ok(_) => Some(ok),
                            _ => None,
                        },
                        Err(_) => None,
                    },
                );
            }
            Where::File => {}
        }
        let path = self.block_file_path(ns, key);
        let file = match self.open_block(&path, self.direct_ok && aligned) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Ok(Some(ReadOutcome::Vanished))
            }
            Err(e) => return Err(Error::io("opening", &path, e)),
        };
        match file.metadata() {
            Ok(m) if m.len() == want => {}
            _ => return Ok(None),
        }
        let mut v = Verifier::header_only(ns, key, want);
        match self
            .engine
            .read_file(file.as_raw_fd(), 0, dst, &mut |piece| v.feed(piece))
        {
            Ok(got) => match v.finish(got as u64) {
                ok @ ReadOutcome::Ok(_) => Ok(Some(ok)),
                _ => Ok(None),
            },
            Err(_) => Ok(None),
        }
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
        if info.slotted {
            return self.open_slotted(ns, key, info);
        }
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

    /// [`G3Store::open_for_read`] of a slotted block: no fd into the slab
    /// (it holds other blocks, other tenants' too), but a sealed memfd
    /// holding this block's bytes, read and verified here first (the
    /// reader verifies again, as for any passed fd).
    fn open_slotted(
        &self,
        ns: &NamespaceId,
        key: &BlockKey,
        info: BlockInfo,
    ) -> Result<Lookup<(File, BlockInfo)>> {
        let len = info.file_len as usize;
        let mut buf = super::engine::AlignedBuf::rounded(len)
            .map_err(|e| Error::io("allocating", "g3 read buffer", e))?;
        match self.read_into(ns, key, &mut buf.as_mut_slice()[..len])? {
            Lookup::Hit(_) => {}
            Lookup::Miss(r) => return Ok(Lookup::Miss(r)),
        }
        let file = sealed_copy(&buf.as_slice()[..len])
            .map_err(|e| Error::io("copying a slotted block", "memfd", e))?;
        Ok(Lookup::Hit((file, info)))
    }
}

/// A sealed memfd (no write, grow or shrink) holding `bytes`.
fn sealed_copy(bytes: &[u8]) -> std::io::Result<File> {
    use std::os::fd::FromRawFd;
    use std::os::unix::fs::FileExt;
    // SAFETY: a NUL-terminated name; memfd_create reads nothing else.
    let fd = unsafe {
        libc::memfd_create(
            c"kvtier-block".as_ptr(),
            libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
        )
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: memfd_create returned a fresh fd that we own.
    let f = unsafe { File::from_raw_fd(fd) };
    // Positioned: the file offset stays 0 for whoever reads the fd.
    f.write_all_at(bytes, 0)?;
    let seals = libc::F_SEAL_WRITE | libc::F_SEAL_GROW | libc::F_SEAL_SHRINK | libc::F_SEAL_SEAL;
    // SAFETY: F_ADD_SEALS on our own memfd; no memory is passed.
    if unsafe { libc::fcntl(f.as_raw_fd(), libc::F_ADD_SEALS, seals) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(f)
}
