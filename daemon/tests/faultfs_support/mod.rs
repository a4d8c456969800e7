//! The real-kernel crash rig (included with `#[path]`): a
//! `kvtier_fs::faultfs::FaultFs` mounted on a temp dir, G3 opened inside
//! it over the production seam (`RealFs`, io_uring), and the mutation
//! switch: `KVTIER_FUSE_POWER_LOSS_SKIP=<sync site>` removes one of G3's
//! durability calls (the wrappers below skip it; with no site set they
//! only pass calls through, so G3 runs its production path).
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs, dead_code)]

use kvtier_daemon::tiers::g3::engine::{AlignedBuf, FillFn, IoEngine, ReadyFn, UringEngine};
use kvtier_daemon::tiers::g3::seam::IndexBackend;
use kvtier_daemon::tiers::g3::seam::{G3Fs, RealFs, SyncSite, Unlink};
use kvtier_fs::faultfs::{CutReport, FaultFs, FaultMount};
use std::io::{self, Write};
use std::os::fd::RawFd;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

/// The site named by `KVTIER_FUSE_POWER_LOSS_SKIP`, if any (an unknown
/// name panics: a typo must not pass as "nothing skipped").
pub fn skip_from_env() -> Option<SyncSite> {
    let name = std::env::var("KVTIER_FUSE_POWER_LOSS_SKIP").ok()?;
    Some(
        SyncSite::ALL
            .iter()
            .copied()
            .find(|s| s.name() == name)
            .unwrap_or_else(|| panic!("KVTIER_FUSE_POWER_LOSS_SKIP={name}: no such sync site")),
    )
}

/// Whether this process may mount FUSE (root and /dev/fuse); prints a
/// SKIP line when not.
pub fn can_mount(test: &str) -> bool {
    if !nix::unistd::geteuid().is_root() || !Path::new("/dev/fuse").exists() {
        eprintln!("SKIP: {test}: mounting FUSE needs root and /dev/fuse");
        return false;
    }
    true
}

/// `RealFs` with one durability call removable, recording block unlinks
/// (delete, eviction) with the filesystem's operation count, which
/// excuse an acknowledged block's absence.
#[derive(Debug)]
pub struct SkipFs {
    pub skip: Option<SyncSite>,
    pub fault: FaultFs,
    pub removed: Mutex<Vec<(u64, PathBuf)>>,
}

impl G3Fs for SkipFs {
    fn create_new(&self, path: &Path, mut flags: i32) -> io::Result<std::fs::File> {
        if self.skip == Some(SyncSite::BlockODsync) {
            flags &= !libc::O_DSYNC;
        }
        RealFs.create_new(path, flags)
    }
    fn write_synced(&self, path: &Path, bytes: &[u8], site: SyncSite) -> io::Result<()> {
        if self.skip == Some(site) {
            let mut f = std::fs::File::create(path)?;
            return f.write_all(bytes);
        }
        RealFs.write_synced(path, bytes, site)
    }
    fn sync_dir(&self, dir: &Path, site: SyncSite) -> io::Result<()> {
        if self.skip == Some(site) {
            return Ok(());
        }
        RealFs.sync_dir(dir, site)
    }
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        RealFs.rename(from, to)
    }
    fn rename_noreplace(&self, from: &Path, to: &Path) -> io::Result<()> {
        RealFs.rename_noreplace(from, to)
    }
    fn remove_file(&self, path: &Path, why: Unlink) -> io::Result<()> {
        if why == Unlink::Block {
            let op = self.fault.counters().ops;
            self.removed.lock().unwrap().push((op, path.to_path_buf()));
        }
        RealFs.remove_file(path, why)
    }
    fn open_existing(&self, path: &Path, mut flags: i32) -> io::Result<std::fs::File> {
        // A recycled block file (g3/recycle.rs): the same mutation as a
        // fresh one's create.
        if self.skip == Some(SyncSite::BlockODsync) {
            flags &= !libc::O_DSYNC;
        }
        RealFs.open_existing(path, flags)
    }
    fn retire(&self, from: &Path, to: &Path) -> io::Result<()> {
        // An eviction into the recycle pool: for the block, a removal
        // like an unlink's, which excuses its absence after a cut
        // (without this the harness counted a recycled eviction as an
        // acknowledged block lost: seed 61535, large-batch-evict).
        let op = self.fault.counters().ops;
        self.removed.lock().unwrap().push((op, from.to_path_buf()));
        RealFs.retire(from, to)
    }
    fn create_dir(&self, path: &Path) -> io::Result<()> {
        RealFs.create_dir(path)
    }
    fn create_dir_all(&self, path: &Path) -> io::Result<()> {
        RealFs.create_dir_all(path)
    }
    fn remove_dir_all(&self, path: &Path) -> io::Result<()> {
        RealFs.remove_dir_all(path)
    }
    fn index_backend(&self, path: &Path) -> io::Result<Option<IndexBackend>> {
        // redb's own file backend, as in production (its sync cannot be
        // removed from here; `index.sync` is not load-bearing anyway).
        RealFs.index_backend(path)
    }
}

/// The production io_uring engine with `block.fdatasync` removable.
pub struct SkipEngine {
    pub inner: UringEngine,
    pub skip: Option<SyncSite>,
}

impl IoEngine for SkipEngine {
    fn name(&self) -> &'static str {
        self.inner.name()
    }
    fn write_file(
        &self,
        fd: RawFd,
        at: u64,
        len: u64,
        bufs: &mut [AlignedBuf],
        fill: FillFn<'_>,
    ) -> io::Result<()> {
        self.inner.write_file(fd, at, len, bufs, fill)
    }
    fn read_file(
        &self,
        fd: RawFd,
        at: u64,
        dst: &mut [u8],
        on_ready: ReadyFn<'_>,
    ) -> io::Result<usize> {
        self.inner.read_file(fd, at, dst, on_ready)
    }
    fn sync_data(&self, fd: RawFd) -> io::Result<()> {
        if self.skip == Some(SyncSite::BlockFdatasync) {
            return Ok(());
        }
        self.inner.sync_data(fd)
    }
}

/// A FaultFs and its mount at `<dir>/mnt`.
pub struct Rig {
    pub dir: tempfile::TempDir,
    pub fault: FaultFs,
    pub mount: Option<FaultMount>,
    pub fs: Arc<SkipFs>,
}

impl Rig {
    pub fn new(seed: u64, skip: Option<SyncSite>) -> Rig {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("mnt")).unwrap();
        let fault = FaultFs::new(seed);
        let fs = Arc::new(SkipFs {
            skip,
            fault: fault.clone(),
            removed: Mutex::new(Vec::new()),
        });
        let mut rig = Rig {
            dir,
            fault,
            mount: None,
            fs,
        };
        rig.mount();
        rig
    }

    pub fn mnt(&self) -> PathBuf {
        self.dir.path().join("mnt")
    }

    pub fn mount(&mut self) {
        assert!(self.mount.is_none());
        self.mount = Some(self.fault.mount(&self.mnt()).expect("mount faultfs"));
    }

    /// Power lost now (if not already), everything using the mount must
    /// be stopped by the caller first; unmounts, takes back what was not
    /// durable, mounts the survivor.
    pub fn power_cycle(&mut self) -> CutReport {
        self.fault.crash_now();
        if let Some(m) = self.mount.take() {
            if let Err(e) = m.unmount() {
                panic!(
                    "unmounting faultfs after the cut failed (something still holds a file): {e}"
                );
            }
        }
        let r = self.fault.power_cycle();
        self.mount();
        r
    }

    pub fn engine(&self) -> Arc<dyn IoEngine> {
        Arc::new(SkipEngine {
            inner: UringEngine::new(4).expect("io_uring"),
            skip: self.fs.skip,
        })
    }
}
