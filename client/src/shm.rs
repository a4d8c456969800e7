//! The per-client shared region: a sealed memfd mapped by both the client and
//! the daemon, so that block bytes cross between them without a socket copy.
//!
//! The client creates the memfd, sizes it, seals its size (`F_SEAL_SHRINK |
//! F_SEAL_GROW | F_SEAL_SEAL`) and hands it to the daemon over SCM_RIGHTS.
//! The daemon refuses a region whose size is not sealed: a client that could
//! shrink it would make the daemon's accesses fault (SIGBUS).
//!
//! Memory accounting: a shared-memory page is charged to the memory cgroup
//! of the process that first faults it in. The client therefore populates
//! every range before it asks the daemon to write there
//! ([`Region::populate`], once per range: a no-op after), so its pages
//! count against the client's cgroup; the daemon checks each range it
//! touches for pages not in memory ([`Region::populated`], `mincore`) and
//! refuses the item, so that
//! a tenant cannot make the daemon's cgroup pay for its memory and push the
//! daemon into OOM (measured: 32 MiB onboarded through a fresh region were
//! charged to the daemon before this). Populating lazily, not at creation,
//! keeps connecting cheap (all of a 64 MiB region: about 200 ms) and a
//! client's memory to what it uses.
//!
//! Safety model: the other side may write the region at any time. All
//! access goes through bounds-checked raw copies or short-lived slices, and
//! nothing read from the region is trusted before it is validated (and, for
//! payloads, checksummed after the copy that is actually kept).

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

/// Largest region accepted (16 GiB).
pub const REGION_BYTES_MAX: u64 = 16 << 30;

/// A mapped shared region.
pub struct Region {
    fd: OwnedFd,
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the mapping is plain shared memory; concurrent access from other
// threads is no different from access by the other process, which the
// module's safety model already assumes.
unsafe impl Send for Region {}
// SAFETY: as above.
unsafe impl Sync for Region {}

fn os_err(what: &str) -> std::io::Error {
    let e = std::io::Error::last_os_error();
    std::io::Error::new(e.kind(), format!("{what}: {e}"))
}

impl Region {
    /// Creates, sizes, seals and maps a new region of `len` bytes (rounded
    /// up to 4096).
    pub fn create(len: u64) -> std::io::Result<Region> {
        let len = len.div_ceil(4096).max(1) * 4096;
        if len > REGION_BYTES_MAX {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("region of {len} bytes exceeds {REGION_BYTES_MAX}"),
            ));
        }
        // SAFETY: a NUL-terminated name and valid flags.
        let raw = unsafe {
            libc::memfd_create(
                c"kvtier-region".as_ptr(),
                libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
            )
        };
        if raw < 0 {
            return Err(os_err("memfd_create"));
        }
        // SAFETY: memfd_create returned a fresh fd that we own.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: fd is valid.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) } != 0 {
            return Err(os_err("ftruncate memfd"));
        }
        let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
        // SAFETY: fd is a sealable memfd.
        if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) } != 0 {
            return Err(os_err("sealing memfd"));
        }
        Self::map(fd, len)
    }

    /// Maps a region received from a client after checking that its size is
    /// sealed and equals `len`.
    pub fn adopt(fd: OwnedFd, len: u64) -> std::io::Result<Region> {
        let bad = |m: String| std::io::Error::new(std::io::ErrorKind::InvalidInput, m);
        if len == 0 || len > REGION_BYTES_MAX || !len.is_multiple_of(4096) {
            return Err(bad(format!("region size {len}")));
        }
        // SAFETY: fd is valid.
        let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
        if seals < 0 {
            return Err(bad("the region is not a sealable memfd".into()));
        }
        let need = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW;
        if seals & need != need {
            return Err(bad("the region's size is not sealed".into()));
        }
        // SAFETY: an all-zero stat is a valid out-parameter.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: fd is valid and st is writable.
        if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
            return Err(os_err("fstat region"));
        }
        if st.st_size as u64 != len {
            return Err(bad(format!(
                "region is {} bytes, the client said {len}",
                st.st_size
            )));
        }
        Self::map(fd, len)
    }

    fn map(fd: OwnedFd, len: u64) -> std::io::Result<Region> {
        let flags = libc::MAP_SHARED;
        // SAFETY: mapping a valid fd of at least len bytes (its size is
        // sealed) with no fixed address.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                flags,
                fd.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(os_err("mmap region"));
        }
        Ok(Region {
            fd,
            ptr: ptr as *mut u8,
            len: len as usize,
        })
    }

    /// Whether every page of `len` bytes at `off` is in memory (no hole),
    /// so that touching them charges nothing new to this process's memory
    /// cgroup. False when out of bounds. `mincore` over the range only (a
    /// `SEEK_HOLE` would walk to the end of a populated region each time);
    /// a page swapped out counts as absent (the caller's populate swaps it
    /// back in, charged to the caller).
    pub fn populated(&self, off: u64, len: usize) -> bool {
        let Some(start) = self.check(off, len) else {
            return false;
        };
        if len == 0 {
            return true;
        }
        const PAGE: usize = 4096;
        const CHUNK_PAGES: usize = 512;
        let first = start / PAGE * PAGE;
        let end = (start + len)
            .div_ceil(PAGE)
            .saturating_mul(PAGE)
            .min(self.len);
        let mut vec = [0u8; CHUNK_PAGES];
        let mut at = first;
        while at < end {
            let n = (end - at).min(CHUNK_PAGES * PAGE);
            let pages = n.div_ceil(PAGE);
            // SAFETY: a page-aligned range inside the live mapping and a
            // vector of at least one byte per page.
            let r = unsafe { libc::mincore(self.ptr.add(at).cast(), n, vec.as_mut_ptr()) };
            if r != 0 || vec[..pages].iter().any(|v| v & 1 == 0) {
                return false;
            }
            at += n;
        }
        true
    }

    /// Faults in, in this process (so charged to its memory cgroup), the
    /// pages of `len` bytes at `off` not yet in memory; a no-op (one
    /// `mincore`) when they are. False when out of bounds or not populated.
    pub fn populate(&self, off: u64, len: usize) -> bool {
        if self.populated(off, len) {
            return true;
        }
        let Some(start) = self.check(off, len) else {
            return false;
        };
        const PAGE: usize = 4096;
        let first = start / PAGE * PAGE;
        let end = (start + len)
            .div_ceil(PAGE)
            .saturating_mul(PAGE)
            .min(self.len);
        // SAFETY: a page-aligned range inside the live mapping; populating
        // writes nothing the other side could observe.
        let r = unsafe {
            libc::madvise(
                self.ptr.add(first).cast(),
                end - first,
                libc::MADV_POPULATE_WRITE,
            )
        };
        if r != 0 {
            // Before Linux 5.14: a read fault on a shared memfd page
            // allocates it just the same.
            for p in (first..end).step_by(PAGE) {
                // SAFETY: in bounds of the live mapping.
                unsafe { std::ptr::read_volatile(self.ptr.add(p)) };
            }
        }
        self.populated(off, len)
    }

    /// Length in bytes.
    #[allow(clippy::len_without_is_empty)]
    pub fn len(&self) -> usize {
        self.len
    }

    /// The memfd (to pass to the daemon).
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    fn check(&self, off: u64, len: usize) -> Option<usize> {
        let off = usize::try_from(off).ok()?;
        let end = off.checked_add(len)?;
        (end <= self.len).then_some(off)
    }

    /// A view of `len` bytes at `off`, or `None` when out of bounds. The
    /// other process may change these bytes while the slice lives: validate
    /// a copy, not the view.
    pub fn slice(&self, off: u64, len: usize) -> Option<&[u8]> {
        let off = self.check(off, len)?;
        // SAFETY: in bounds of a live mapping; see the module safety model.
        Some(unsafe { std::slice::from_raw_parts(self.ptr.add(off), len) })
    }

    /// A mutable view of `len` bytes at `off`. Takes `&self` because the
    /// region is shared with another process anyway; callers coordinate by
    /// protocol (one request owns its offsets until its reply).
    #[allow(clippy::mut_from_ref)]
    pub fn slice_mut(&self, off: u64, len: usize) -> Option<&mut [u8]> {
        let off = self.check(off, len)?;
        // SAFETY: in bounds of a live mapping; see the module safety model.
        Some(unsafe { std::slice::from_raw_parts_mut(self.ptr.add(off), len) })
    }

    /// Copies `src` into the region at `off`; false when out of bounds.
    pub fn write(&self, off: u64, src: &[u8]) -> bool {
        match self.slice_mut(off, src.len()) {
            Some(d) => {
                d.copy_from_slice(src);
                true
            }
            None => false,
        }
    }

    /// Copies `dst.len()` bytes from the region at `off`; false when out of
    /// bounds.
    pub fn read(&self, off: u64, dst: &mut [u8]) -> bool {
        match self.slice(off, dst.len()) {
            Some(s) => {
                dst.copy_from_slice(s);
                true
            }
            None => false,
        }
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: ptr/len came from a successful mmap and are unmapped once.
        unsafe { libc::munmap(self.ptr as *mut libc::c_void, self.len) };
    }
}

impl std::fmt::Debug for Region {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Region({} bytes)", self.len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sealed_region_is_shared_and_bounds_checked() {
        let a = Region::create(8192).unwrap();
        let fd = a.fd().try_clone_to_owned().unwrap();
        let b = Region::adopt(fd, 8192).unwrap();
        assert!(a.write(4096, b"hello"));
        let mut got = [0u8; 5];
        assert!(b.read(4096, &mut got));
        assert_eq!(&got, b"hello");
        assert!(!a.write(8190, b"hello"));
        assert!(b.slice(u64::MAX, 1).is_none());
        let fd = a.fd().try_clone_to_owned().unwrap();
        assert!(Region::adopt(fd, 4096).is_err(), "size mismatch accepted");
    }

    #[test]
    fn populate_fills_a_range_and_a_punched_hole_is_seen() {
        // Created: nothing populated until asked.
        let r = Region::create(1 << 20).unwrap();
        assert!(!r.populated(0, 4096));
        assert!(r.populate(100, 20_000));
        assert!(r.populated(0, 20_480));
        assert!(!r.populated(0, 24_577));
        assert!(r.populate(0, r.len()));
        assert!(r.populated(0, r.len()));
        // Adopted by the other side: populated there too (one memfd).
        let (fd2, len) = (r.fd().try_clone_to_owned().unwrap(), r.len() as u64);
        let seen = Region::adopt(fd2, len).unwrap();
        assert!(seen.populated(0, seen.len()));
        // Sized and sealed but never touched: no page populated.
        // SAFETY: a NUL-terminated name and valid flags.
        let raw = unsafe {
            libc::memfd_create(c"t".as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING)
        };
        // SAFETY: fresh fd we own.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: valid fd.
        unsafe {
            assert_eq!(libc::ftruncate(fd.as_raw_fd(), 1 << 20), 0);
            assert_eq!(
                libc::fcntl(
                    fd.as_raw_fd(),
                    libc::F_ADD_SEALS,
                    libc::F_SEAL_SHRINK | libc::F_SEAL_GROW
                ),
                0
            );
        }
        let sparse = Region::adopt(fd, 1 << 20).unwrap();
        assert!(!sparse.populated(0, 4096));
        // A hole punched later shows in the range that holds it only.
        // SAFETY: valid fd; punching a page of our own memfd.
        let punched = unsafe {
            libc::fallocate(
                r.fd().as_raw_fd(),
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                8192,
                4096,
            )
        };
        assert_eq!(punched, 0);
        assert!(r.populated(0, 8192));
        assert!(!r.populated(4096, 8192));
        assert!(r.populated(12288, 4096));
        assert!(!r.populated(0, r.len() + 1));
    }

    #[test]
    fn unsealed_memfd_is_refused() {
        // SAFETY: valid name and flags.
        let raw = unsafe { libc::memfd_create(c"t".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(raw >= 0);
        // SAFETY: fresh fd.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: valid fd.
        assert_eq!(unsafe { libc::ftruncate(fd.as_raw_fd(), 4096) }, 0);
        assert!(Region::adopt(fd, 4096).is_err());
    }
}
