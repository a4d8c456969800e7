//! Filesystem calls beyond plain `std::fs`: the directory fsync that makes
//! entries durable, the rename that never replaces a block, and the
//! O_DIRECT probe run at open.

use super::seam::{G3Fs, Unlink};
use crate::base::error::{Error, Result};
use std::fs::File;
use std::path::Path;

/// Opens a directory and fsyncs it (makes entries in it durable).
pub(super) fn fsync_dir(dir: &Path) -> std::io::Result<()> {
    File::open(dir)?.sync_all()
}

/// Whether files under `dir` can be opened with O_DIRECT (tmpfs and some
/// others refuse with EINVAL; then the store runs buffered).
pub(super) fn probe_direct(fs: &dyn G3Fs, dir: &Path) -> Result<bool> {
    let p = dir.join(format!(".direct-probe.{}", std::process::id()));
    let _ = fs.remove_file(&p, Unlink::Temp);
    let r = fs.create_new(&p, libc::O_DIRECT | libc::O_CLOEXEC);
    if r.is_ok() {
        let _ = fs.remove_file(&p, Unlink::Temp);
    }
    match r {
        Ok(_) => Ok(true),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
            tracing::warn!(dir = %dir.display(), "g3: filesystem refuses O_DIRECT; using buffered I/O");
            Ok(false)
        }
        Err(e) => Err(Error::io("probing O_DIRECT in", dir, e)),
    }
}

/// Whether `syncfs` on the filesystem holding `dir` makes written data
/// durable: the local journaling and log-structured filesystems flush the
/// device in their sync_fs; tmpfs holds nothing durable either way. FUSE
/// (unless the server implements FUSE_SYNCFS, which the kernel sends only
/// for virtiofs), NFS and the rest are not trusted with it.
pub(super) fn syncfs_flushes(dir: &Path) -> bool {
    const EXT4: i64 = 0xEF53;
    const XFS: i64 = 0x5846_5342;
    const BTRFS: i64 = 0x9123_683E;
    const F2FS: i64 = 0xF2F5_2010;
    const TMPFS: i64 = 0x0102_1994;
    let Ok(c) = std::ffi::CString::new(std::os::unix::ffi::OsStrExt::as_bytes(dir.as_os_str()))
    else {
        return false;
    };
    // SAFETY: statfs is plain old data; all zeroes is a valid value.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: statfs writes one struct into `st`; `c` is NUL-terminated.
    if unsafe { libc::statfs(c.as_ptr(), &mut st) } != 0 {
        return false;
    }
    #[allow(clippy::unnecessary_cast)] // f_type's width differs by target
    let t = st.f_type as i64;
    matches!(t, EXT4 | XFS | BTRFS | F2FS | TMPFS)
}

/// rename(2) that refuses to replace an existing name (renameat2
/// RENAME_NOREPLACE), falling back to a link+unlink where unsupported.
pub(super) fn rename_noreplace(from: &Path, to: &Path) -> std::io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let c = |p: &Path| {
        std::ffi::CString::new(p.as_os_str().as_bytes())
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))
    };
    let (f, t) = (c(from)?, c(to)?);
    // SAFETY: both are valid NUL-terminated paths.
    let r = unsafe {
        libc::renameat2(
            libc::AT_FDCWD,
            f.as_ptr(),
            libc::AT_FDCWD,
            t.as_ptr(),
            libc::RENAME_NOREPLACE,
        )
    };
    if r == 0 {
        return Ok(());
    }
    let e = std::io::Error::last_os_error();
    if e.raw_os_error() == Some(libc::EINVAL) {
        std::fs::hard_link(from, to)?;
        return std::fs::remove_file(from);
    }
    Err(e)
}

/// fallocate(PUNCH_HOLE | KEEP_SIZE): the range's blocks are freed and
/// read as zeros; the file keeps its length.
pub(super) fn punch_hole(file: &std::fs::File, off: u64, len: u64) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    loop {
        // SAFETY: fallocate reads no memory; a bad fd or range is an errno.
        let r = unsafe {
            libc::fallocate(
                file.as_raw_fd(),
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                off as libc::off_t,
                len as libc::off_t,
            )
        };
        if r == 0 {
            return Ok(());
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}
