//! How bytes move: one interface, two engines (io_uring, pread/pwrite).
//!
//! An engine moves whole block files: `write_file` streams a file through
//! pool buffers that the caller fills chunk by chunk, `read_file` reads a
//! file into one destination and hands each completed, contiguous piece to
//! the caller while later pieces are still in flight (so the checksum runs
//! in the I/O pipeline, not after it). The engine knows nothing about
//! blocks, the index or checksums.

use std::io;
use std::os::fd::RawFd;

pub mod pread;
pub mod uring;

pub use pread::PreadEngine;
pub use uring::UringEngine;

/// Size of one I/O request, and of one pool buffer. Large enough for the
/// disk to stream, small enough that hashing overlaps the next request.
pub const CHUNK_BYTES: usize = 1 << 20;
/// Requests one block operation keeps in flight (the ring size).
pub const CHUNKS_IN_FLIGHT_MAX: usize = 8;

/// Which engine a store asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EngineKind {
    /// io_uring when the kernel allows it, else pread/pwrite.
    #[default]
    Auto,
    /// io_uring or fail at open.
    Uring,
    /// Plain pread/pwrite.
    Pread,
}

/// The 4096-aligned O_DIRECT buffer (shared with the GDS crate and the
/// benches); the engine allocates its buffers once at start-up.
pub use kvtier_client::AlignedBuf;

/// Fills the chunk of the file that starts at the given offset.
pub type FillFn<'a> = &'a mut dyn FnMut(u64, &mut [u8]);
/// Receives the next contiguous piece of the file, in file order.
pub type ReadyFn<'a> = &'a mut dyn FnMut(&[u8]);

/// One read of a batch ([`IoEngine::read_many`]): `dst.len()` bytes at
/// offset `at` of `fd`.
#[derive(Debug)]
pub struct ReadReq<'a> {
    /// The file.
    pub fd: RawFd,
    /// Where in it.
    pub at: u64,
    /// Where to.
    pub dst: &'a mut [u8],
}

/// An I/O engine. Implementations must not return while the kernel still
/// holds a pointer into a caller's buffer (on error too).
pub trait IoEngine: Send + Sync {
    /// `io_uring` or `pread`.
    fn name(&self) -> &'static str;
    /// Writes `len` bytes (a multiple of 4096) at offset `at` of `fd` (0
    /// for a block file, the slot's offset in a slab file, slots.rs).
    /// Chunk `i` covers `[i * bufs[0].len(), ..)` of those bytes; `fill`
    /// gets that offset (relative to `at`) and writes the chunk's bytes
    /// into a pool buffer just before it is submitted. Not durable until
    /// [`IoEngine::sync_data`].
    fn write_file(
        &self,
        fd: RawFd,
        at: u64,
        len: u64,
        bufs: &mut [AlignedBuf],
        fill: FillFn<'_>,
    ) -> io::Result<()>;
    /// Reads `dst.len()` bytes from offset `at`; `on_ready` sees every
    /// completed piece in file order. Returns the bytes read: fewer than
    /// `dst.len()` means the file ended early.
    fn read_file(
        &self,
        fd: RawFd,
        at: u64,
        dst: &mut [u8],
        on_ready: ReadyFn<'_>,
    ) -> io::Result<usize>;
    /// Reads every request of a batch; one outcome per request, in order:
    /// the bytes read (fewer than `dst.len()` means the file ended early)
    /// or the error. The io_uring engine keeps the whole batch's requests
    /// in flight on one ring from the calling thread (no thread and no
    /// ring per read); the default reads them one after another.
    fn read_many(&self, reqs: &mut [ReadReq<'_>]) -> Vec<io::Result<usize>> {
        reqs.iter_mut()
            .map(|r| self.read_file(r.fd, r.at, r.dst, &mut |_| {}))
            .collect()
    }
    /// fdatasync.
    fn sync_data(&self, fd: RawFd) -> io::Result<()>;
    /// syncfs(2) of the filesystem holding `fd`: every write completed
    /// before it, to any file there, is durable when it returns (the
    /// group flush, group.rs). Errors since Linux 5.8 include writeback
    /// and device-flush failures.
    fn sync_fs(&self, fd: RawFd) -> io::Result<()> {
        // SAFETY: syncfs reads nothing from memory; a bad fd is EBADF.
        if unsafe { libc::syncfs(fd) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }
}

/// Reads until `buf` is full or EOF with plain pread (the short-read path of
/// both engines).
pub(crate) fn pread_full(fd: RawFd, buf: &mut [u8], mut off: u64) -> io::Result<usize> {
    let mut done = 0;
    while done < buf.len() {
        let rest = &mut buf[done..];
        // SAFETY: rest is a valid writable region of rest.len() bytes.
        let n =
            unsafe { libc::pread(fd, rest.as_mut_ptr().cast(), rest.len(), off as libc::off_t) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if n == 0 {
            break;
        }
        done += n as usize;
        off += n as u64;
    }
    Ok(done)
}

/// Writes all of `buf` with plain pwrite.
pub(crate) fn pwrite_full(fd: RawFd, buf: &[u8], mut off: u64) -> io::Result<()> {
    let mut done = 0;
    while done < buf.len() {
        let rest = &buf[done..];
        // SAFETY: rest is a valid readable region of rest.len() bytes.
        let n = unsafe { libc::pwrite(fd, rest.as_ptr().cast(), rest.len(), off as libc::off_t) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::WriteZero,
                "pwrite wrote 0 bytes",
            ));
        }
        done += n as usize;
        off += n as u64;
    }
    Ok(())
}

/// fdatasync, retried on EINTR.
pub(crate) fn fdatasync(fd: RawFd) -> io::Result<()> {
    loop {
        // SAFETY: fdatasync has no memory preconditions.
        if unsafe { libc::fdatasync(fd) } == 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}
