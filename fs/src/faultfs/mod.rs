//! A fault-injecting FUSE filesystem for crash tests (test support, never
//! mounted by the product): the real kernel in front, an in-memory tree
//! behind it that knows what was made durable, and a power switch.
//!
//! Durable means: a file's bytes after an fsync/fdatasync of it (FUSE
//! FSYNC) or, range by range, a write carrying O_DSYNC/O_SYNC when it
//! returns; a directory's entries after an fsync of that directory (FUSE
//! FSYNCDIR). Nothing else is (no journal ordering, close is not a
//! flush): the plain POSIX model.
//!
//! Use: [`FaultFs::new`], [`FaultFs::mount`] (root and `/dev/fuse`),
//! run the code under test in the mount, [`FaultFs::set_crash_at`] (an
//! operation count) or [`FaultFs::crash_now`]: that operation and every
//! later one fail with EIO. Stop the code under test, drop the
//! [`FaultMount`] (unmounts), [`FaultFs::power_cycle`] (the tree becomes
//! what was durable), mount again and look at what survived.
//!
//! Found while building it (kernel 6.18, fs/tests/mount_faultfs/ and
//! daemon/tests/g3_fuse_power_loss.rs): open(O_DIRECT) on FUSE succeeds
//! without `FOPEN_DIRECT_IO` (the kernel's direct-I/O path sends each
//! write to the filesystem as it happens), so G3's O_DIRECT probe passes
//! and its io_uring engine reads and writes such files unchanged. An
//! O_DSYNC write arrives as WRITE with O_DSYNC in its flags and then an
//! FSYNC (the kernel's generic_write_sync); an fsync of a directory
//! arrives as FSYNCDIR (a filesystem answering ENOSYS there would make
//! every later directory fsync a silent success); renameat2 with
//! RENAME_NOREPLACE arrives with the flag.

mod fuse;
mod model;

pub use model::{Counters, CutReport};

use fuser::{MountOption, SessionACL};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

/// What the adapter and the test's handle share.
pub(crate) struct Shared {
    model: Mutex<model::Model>,
    direct_io_flag: bool,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, model::Model> {
        self.model.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The filesystem's state and its power switch (see the module doc).
/// Clones share one tree.
#[derive(Clone)]
pub struct FaultFs {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for FaultFs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FaultFs")
            .field("counters", &self.counters())
            .finish()
    }
}

/// A mounted [`FaultFs`]. Dropping it unmounts; when the mount is busy it
/// is detached (`umount2(MNT_DETACH)`, then `fusermount3 -uz`), so a
/// failing test never leaves it behind.
#[derive(Debug)]
pub struct FaultMount {
    session: Option<fuser::BackgroundSession>,
    mountpoint: PathBuf,
}

impl FaultFs {
    /// An empty filesystem. `seed` drives what write-back kept of unsynced
    /// bytes at each power cut.
    pub fn new(seed: u64) -> Self {
        Self::with_direct_io_flag(seed, false)
    }

    /// Like [`FaultFs::new`]; `direct_io_flag`: answer opens that carry
    /// O_DIRECT with `FOPEN_DIRECT_IO` (the kernel then bypasses its page
    /// cache for every I/O on that file).
    pub fn with_direct_io_flag(seed: u64, direct_io_flag: bool) -> Self {
        FaultFs {
            shared: Arc::new(Shared {
                model: Mutex::new(model::Model::new(seed)),
                direct_io_flag,
            }),
        }
    }

    /// Mounts the tree at `mountpoint` (an existing, empty directory).
    pub fn mount(&self, mountpoint: &Path) -> std::io::Result<FaultMount> {
        let mut cfg = fuser::Config::default();
        cfg.mount_options = vec![
            MountOption::FSName("kvtier-faultfs".into()),
            MountOption::Subtype("faultfs".into()),
            MountOption::RW,
            MountOption::NoAtime,
        ];
        cfg.acl = SessionACL::Owner;
        cfg.n_threads = Some(2);
        let adapter = fuse::Adapter {
            shared: Arc::clone(&self.shared),
        };
        let session = fuser::Session::new(adapter, mountpoint, &cfg)?.spawn()?;
        Ok(FaultMount {
            session: Some(session),
            mountpoint: mountpoint.to_path_buf(),
        })
    }

    /// Power is lost at operation number `op` (counted from the start,
    /// see [`Counters::ops`]); `None`: never.
    pub fn set_crash_at(&self, op: Option<u64>) {
        self.shared.lock().set_crash_at(op);
    }

    /// Power is lost now.
    pub fn crash_now(&self) {
        self.shared.lock().crash_now();
    }

    /// Whether power was lost (and not yet restored).
    pub fn crashed(&self) -> bool {
        self.shared.lock().crashed()
    }

    /// What was counted so far.
    pub fn counters(&self) -> Counters {
        self.shared.lock().counters
    }

    /// Power comes back: the tree becomes what was durable (unmount
    /// first; a mount still up would keep serving names the kernel
    /// cached).
    pub fn power_cycle(&self) -> CutReport {
        self.shared.lock().cut()
    }
}

impl FaultMount {
    /// Where it is mounted.
    pub fn mountpoint(&self) -> &Path {
        &self.mountpoint
    }

    /// Unmounts now, waiting up to [`UNMOUNT_BUSY_WAIT_MS`] for a file
    /// reference the kernel is still dropping.
    pub fn unmount(self) -> std::io::Result<()> {
        self.unmount_within(UNMOUNT_BUSY_WAIT_MS)
    }

    /// Like [`FaultMount::unmount`], waiting at most `busy_wait_ms` while
    /// the mount is busy; still busy: the error names what of this
    /// process holds a file there, and the mount is detached.
    pub fn unmount_within(mut self, busy_wait_ms: u64) -> std::io::Result<()> {
        self.unmount_inner(busy_wait_ms)
    }

    fn unmount_inner(&mut self, busy_wait_ms: u64) -> std::io::Result<()> {
        let Some(session) = self.session.take() else {
            return Ok(());
        };
        match unmount_when_free(&self.mountpoint, busy_wait_ms) {
            // Unmounted: the session thread ends on the device's ENODEV,
            // or on ECONNABORTED when the kernel marked the connection
            // aborted as the superblock went (seen once under load in the
            // fault suite): both are the end of a finished session.
            Ok(()) => match session.join() {
                Err(e) if e.raw_os_error() == Some(libc::ECONNABORTED) => Ok(()),
                r => r,
            },
            Err(e) => {
                // Busy for good: detach, so the next mount (or the temp
                // dir's removal) is not blocked; the session thread ends
                // when the last file is closed.
                detach(&self.mountpoint);
                drop(session);
                Err(e)
            }
        }
    }
}

/// How long [`FaultMount::unmount`] retries a busy mount before it
/// reports it busy. The last close of a file does not always drop the
/// kernel's last reference to it at once: an io_uring ring's teardown
/// and a request completed after its submitter left run from a kernel
/// workqueue, and a child process between fork and exec holds a copy of
/// every descriptor (a CI run saw EBUSY once right after the power-loss
/// harness had closed and dropped its store).
pub const UNMOUNT_BUSY_WAIT_MS: u64 = 5_000;

/// Unmounts `mountpoint` (a plain umount, never lazy), retrying while it
/// is busy for at most `busy_wait_ms`. Still busy after that: the error
/// names what of this process holds a file there.
fn unmount_when_free(mountpoint: &Path, busy_wait_ms: u64) -> std::io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(mountpoint.as_os_str().as_bytes())
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
    let deadline = std::time::Instant::now() + std::time::Duration::from_millis(busy_wait_ms);
    loop {
        // SAFETY: `c` is a valid NUL-terminated path during the call.
        if unsafe { libc::umount2(c.as_ptr(), 0) } == 0 {
            return Ok(());
        }
        let e = std::io::Error::last_os_error();
        match e.raw_os_error() {
            // Not (or no longer) a mount point: fuser's own unmount
            // then finds nothing to do.
            Some(libc::EINVAL) | Some(libc::ENOENT) => return Ok(()),
            Some(libc::EBUSY) if std::time::Instant::now() < deadline => {
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            Some(libc::EBUSY) => {
                return Err(std::io::Error::new(
                    e.kind(),
                    format!(
                        "{e}; still busy after {busy_wait_ms} ms; this process's \
                         descriptors there: {}",
                        open_under(mountpoint)
                    ),
                ))
            }
            _ => return Err(e),
        }
    }
}

/// This process's open descriptors under `dir`, as `fd -> path`, or
/// "none" (then the reference is the kernel's or another process's).
fn open_under(dir: &Path) -> String {
    let Ok(rd) = std::fs::read_dir("/proc/self/fd") else {
        return "unknown (/proc/self/fd unreadable)".into();
    };
    let held: Vec<String> = rd
        .flatten()
        .filter_map(|e| {
            let target = std::fs::read_link(e.path()).ok()?;
            target.starts_with(dir).then(|| {
                format!(
                    "{} -> {}",
                    e.file_name().to_string_lossy(),
                    target.display()
                )
            })
        })
        .collect();
    if held.is_empty() {
        "none".into()
    } else {
        held.join(", ")
    }
}

fn detach(mountpoint: &Path) {
    use std::os::unix::ffi::OsStrExt;
    if let Ok(c) = std::ffi::CString::new(mountpoint.as_os_str().as_bytes()) {
        // SAFETY: `c` is a valid NUL-terminated path during the call.
        if unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) } == 0 {
            return;
        }
    }
    let _ = std::process::Command::new("fusermount3")
        .arg("-uz")
        .arg(mountpoint)
        .status();
}

impl Drop for FaultMount {
    fn drop(&mut self) {
        if let Err(e) = self.unmount_inner(UNMOUNT_BUSY_WAIT_MS) {
            tracing::warn!(mountpoint = %self.mountpoint.display(), error = %e,
                "faultfs: unmount failed; detached");
        }
    }
}
