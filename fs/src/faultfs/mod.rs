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

    /// Unmounts now.
    pub fn unmount(mut self) -> std::io::Result<()> {
        self.unmount_inner()
    }

    fn unmount_inner(&mut self) -> std::io::Result<()> {
        let Some(session) = self.session.take() else {
            return Ok(());
        };
        match session.umount_and_join() {
            Ok(()) => Ok(()),
            Err(e) => {
                // Busy: detach, so the next mount (or the temp dir's
                // removal) is not blocked; the session thread ends when
                // the last file is closed.
                detach(&self.mountpoint);
                Err(e)
            }
        }
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
        if let Err(e) = self.unmount_inner() {
            tracing::warn!(mountpoint = %self.mountpoint.display(), error = %e,
                "faultfs: unmount failed; detached");
        }
    }
}
