//! A power-loss simulator behind the [`super::seam::G3Fs`] seam (the crash
//! harness's filesystem; the model is the POSIX one ALICE and CrashMonkey
//! use, without a journal's extra ordering).
//!
//! Operations run on real files (a real directory, the real io_uring
//! engine for block data), and the simulator keeps what a power cut would
//! take back:
//! - file data: per inode, the content at its last fsync/fdatasync (or
//!   O_DSYNC write, or, for block files, any later syncfs: see
//!   `PowerLossEngine::sync_fs`); a write to a clean inode first saves
//!   that content;
//! - directory entries: every create, rename, unlink and mkdir is logged
//!   as a change of one entry (`dir/name`: old inode -> new inode); an
//!   fsync of `dir` makes the changes in `dir` durable (drops them from
//!   the log). A rename changes two entries, each durable with its own
//!   directory.
//!
//! Every inode the simulator sees gets a hard link in a "grave" directory
//! beside the store, so undoing an unlink or a rename can bring the inode
//! back. At the seeded crash point (an operation count) the machine
//! "loses power": that operation and every later one fail with EIO and
//! change nothing. [`PowerLossFs::power_cycle`] then undoes every change
//! not made durable (newest first) and restores each dirty inode's data to
//! its synced content, or (seeded) keeps the unsynced writes whole or
//! torn at a page boundary, as a real disk's write-back may have done.
//!
//! Real fsyncs are skipped (durability is what the model says), which
//! keeps iterations fast. Not modelled: renames of directories and
//! `remove_dir_all` (only quarantine housekeeping does them; they count
//! as durable at once).

use super::engine::{AlignedBuf, FillFn, IoEngine, ReadyFn};
use super::seam::{G3Fs, SyncSite, Unlink};
use rand::{Rng, SeedableRng};
use std::collections::{HashMap, HashSet};
use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

const PAGE_BYTES: usize = 4096;

#[derive(Debug, Clone, Copy)]
enum Node {
    File(u64),
}

/// One directory entry changed: `path` (in `dir`) went from `old` to `new`.
#[derive(Debug)]
struct Change {
    dir: PathBuf,
    path: PathBuf,
    old: Option<Node>,
}

#[derive(Debug)]
struct State {
    ops: u64,
    crash_at: Option<u64>,
    crashed: bool,
    skip: Option<SyncSite>,
    /// Inode -> its content at the last sync (only inodes written since).
    dirty: HashMap<u64, Vec<u8>>,
    /// Inodes the block-data engine wrote since the last syncfs (what a
    /// syncfs credits: see `PowerLossEngine::sync_fs`).
    block_data: HashSet<u64>,
    changes: Vec<Change>,
    removed_blocks: Vec<(u64, PathBuf)>,
    graves: u64,
    rng: rand::rngs::StdRng,
    /// Every operation, for a failing check's report ([`PowerLossFs::log`]).
    log: Vec<String>,
}

impl State {
    /// Appends one line to the operation log.
    fn note(&mut self, what: std::fmt::Arguments<'_>) {
        let line = format!("{} {what}", self.ops);
        self.log.push(line);
    }
}

/// What one [`PowerLossFs::power_cycle`] took back.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PowerCycle {
    /// Directory-entry changes undone.
    pub entries_undone: u64,
    /// Inodes whose unsynced writes were dropped.
    pub files_dropped: u64,
    /// Inodes whose unsynced writes were kept whole.
    pub files_kept: u64,
    /// Inodes left torn (new pages up to a page boundary, old after).
    pub files_torn: u64,
}

/// The simulator (see the module doc). Share as `Arc<PowerLossFs>`.
pub struct PowerLossFs {
    shared: Arc<Shared>,
}

/// What the simulator and the index files it hands out share (internal:
/// no public methods).
#[doc(hidden)]
pub struct Shared {
    grave: PathBuf,
    st: Mutex<State>,
}

impl std::ops::Deref for PowerLossFs {
    type Target = Shared;
    fn deref(&self) -> &Shared {
        &self.shared
    }
}

impl std::fmt::Debug for PowerLossFs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PowerLossFs")
            .field("grave", &self.shared.grave)
            .finish()
    }
}

fn eio() -> io::Error {
    io::Error::from_raw_os_error(libc::EIO)
}

fn ino_of_fd(fd: RawFd) -> io::Result<u64> {
    // SAFETY: stat is plain old data; all zeroes is a valid value.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fstat writes one stat struct into `st`.
    if unsafe { libc::fstat(fd, &mut st) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(st.st_ino)
}

fn parent(p: &Path) -> PathBuf {
    p.parent().map(Path::to_path_buf).unwrap_or_default()
}

impl PowerLossFs {
    /// A simulator whose grave directory is `grave` (created; must be on
    /// the same filesystem as the store, for hard links). `seed` drives
    /// what write-back kept at each power cut.
    pub fn new(grave: impl Into<PathBuf>, seed: u64) -> io::Result<Arc<Self>> {
        let grave = grave.into();
        std::fs::create_dir_all(&grave)?;
        Ok(Arc::new(PowerLossFs {
            shared: Arc::new(Shared {
                grave,
                st: Mutex::new(State {
                    ops: 0,
                    crash_at: None,
                    crashed: false,
                    skip: None,
                    dirty: HashMap::new(),
                    block_data: HashSet::new(),
                    changes: Vec::new(),
                    removed_blocks: Vec::new(),
                    graves: 0,
                    rng: rand::rngs::StdRng::seed_from_u64(seed),
                    log: Vec::new(),
                }),
            }),
        }))
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.st.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl PowerLossFs {
    /// Operations counted so far (the crash point's unit).
    pub fn ops(&self) -> u64 {
        self.lock().ops
    }

    /// Power is lost at operation number `op` (0-based, absolute; `None`:
    /// never).
    pub fn set_crash_at(&self, op: Option<u64>) {
        self.lock().crash_at = op;
    }

    /// Power is lost now: every later operation fails.
    pub fn crash_now(&self) {
        self.lock().crashed = true;
    }

    /// Whether power was lost.
    pub fn crashed(&self) -> bool {
        self.lock().crashed
    }

    /// The mutation check: `site`'s durability call does nothing.
    pub fn set_skip(&self, site: Option<SyncSite>) {
        self.lock().skip = site;
    }

    /// Every operation and power cycle so far, one line each (operation
    /// number first): what a failing check prints.
    pub fn log(&self) -> Vec<String> {
        self.lock().log.clone()
    }

    /// Adds the caller's line to the log (what the workload did).
    pub fn note(&self, line: &str) {
        self.lock().note(format_args!("{line}"));
    }

    /// Block files unlinked (delete or eviction): (operation number, path).
    pub fn removed_blocks(&self) -> Vec<(u64, PathBuf)> {
        self.lock().removed_blocks.clone()
    }

    /// Wraps the engine that moves block data, so that its writes and
    /// fdatasyncs are tracked too.
    pub fn engine(self: &Arc<Self>, inner: Arc<dyn IoEngine>) -> Arc<dyn IoEngine> {
        Arc::new(PowerLossEngine {
            fs: Arc::clone(self),
            inner,
        })
    }
}

impl Shared {
    /// Counts one operation; fails once power is lost.
    fn op(&self) -> io::Result<MutexGuard<'_, State>> {
        let mut st = self.lock();
        if !st.crashed && st.crash_at.is_some_and(|k| st.ops >= k) {
            st.crashed = true;
            st.note(format_args!("POWER LOST"));
        }
        st.ops += 1;
        if st.crashed {
            return Err(eio());
        }
        Ok(st)
    }

    fn grave_of(&self, ino: u64) -> PathBuf {
        self.grave.join(format!("i{ino}"))
    }

    /// Gives the file at `path` a grave link (so its inode can come back).
    fn bury(&self, path: &Path) -> io::Result<u64> {
        let ino = std::fs::symlink_metadata(path)?.ino();
        let g = self.grave_of(ino);
        if !g.exists() {
            std::fs::hard_link(path, &g)?;
        }
        Ok(ino)
    }

    /// Saves the synced content of `ino` before its first unsynced write.
    fn before_write(&self, st: &mut State, ino: u64) -> io::Result<()> {
        if let std::collections::hash_map::Entry::Vacant(v) = st.dirty.entry(ino) {
            v.insert(std::fs::read(self.grave_of(ino))?);
        }
        Ok(())
    }

    fn created(&self, st: &mut State, path: &Path, ino: u64) -> io::Result<()> {
        std::fs::hard_link(path, self.grave_of(ino))?;
        st.note(format_args!("create {} i{ino}", path.display()));
        st.dirty.insert(ino, Vec::new());
        st.changes.push(Change {
            dir: parent(path),
            path: path.to_path_buf(),
            old: None,
        });
        Ok(())
    }

    fn synced(st: &mut State, ino: u64, site: SyncSite) {
        st.note(format_args!("sync i{ino} {site:?}"));
        if st.skip != Some(site) {
            st.dirty.remove(&ino);
        }
    }

    fn renamed(&self, st: &mut State, from: &Path, to: &Path, replaced: Option<u64>, ino: u64) {
        st.note(format_args!(
            "rename i{ino} {} -> {} (replaced {replaced:?})",
            from.display(),
            to.display()
        ));
        st.changes.push(Change {
            dir: parent(from),
            path: from.to_path_buf(),
            old: Some(Node::File(ino)),
        });
        st.changes.push(Change {
            dir: parent(to),
            path: to.to_path_buf(),
            old: replaced.map(Node::File),
        });
    }
}

impl PowerLossFs {
    /// Takes back everything not made durable (see the module doc) and
    /// powers on again: the crash point is cleared, the log emptied (what
    /// is on disk now is durable), the grave emptied.
    pub fn power_cycle(&self) -> io::Result<PowerCycle> {
        let mut st = self.lock();
        let mut rep = PowerCycle::default();
        st.note(format_args!("power cycle"));
        let changes = std::mem::take(&mut st.changes);
        for c in changes.iter().rev() {
            st.note(format_args!(
                "  undo {} back to {:?}",
                c.path.display(),
                c.old
            ));
            match std::fs::symlink_metadata(&c.path) {
                Ok(m) if m.is_dir() => {
                    st.graves += 1;
                    let to = self.grave.join(format!("d{}", st.graves));
                    std::fs::rename(&c.path, to)?;
                }
                Ok(_) => std::fs::remove_file(&c.path)?,
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(e),
            }
            match c.old {
                Some(Node::File(ino)) => std::fs::hard_link(self.grave_of(ino), &c.path)?,
                None => {}
            }
            rep.entries_undone += 1;
        }
        let dirty = std::mem::take(&mut st.dirty);
        st.block_data.clear();
        let mut inos: Vec<_> = dirty.into_iter().collect();
        inos.sort_unstable_by_key(|(ino, _)| *ino);
        for (ino, synced) in inos {
            let g = self.grave_of(ino);
            let cur = std::fs::read(&g)?;
            let draw = st.rng.random_range(0..100u32);
            st.note(format_args!("  data i{ino}: draw {draw}"));
            let next = if draw < 70 {
                rep.files_dropped += 1;
                synced
            } else if draw < 85 {
                rep.files_kept += 1;
                continue;
            } else {
                rep.files_torn += 1;
                let pages = cur.len().max(synced.len()).div_ceil(PAGE_BYTES);
                let cut = st.rng.random_range(0..=pages) * PAGE_BYTES;
                let len = if st.rng.random_bool(0.5) {
                    cur.len()
                } else {
                    synced.len()
                };
                (0..len)
                    .map(|i| {
                        let src = if i < cut { &cur } else { &synced };
                        src.get(i).copied().unwrap_or(0)
                    })
                    .collect()
            };
            let mut f = OpenOptions::new().write(true).truncate(true).open(&g)?;
            f.write_all(&next)?;
        }
        st.crashed = false;
        st.crash_at = None;
        drop(st);
        std::fs::remove_dir_all(&self.grave)?;
        std::fs::create_dir_all(&self.grave)?;
        Ok(rep)
    }
}

impl G3Fs for PowerLossFs {
    fn create_new(&self, path: &Path, custom_flags: i32) -> io::Result<File> {
        let mut st = self.op()?;
        let f = OpenOptions::new()
            .write(true)
            .create_new(true)
            .custom_flags(custom_flags)
            .open(path)?;
        let ino = ino_of_fd(f.as_raw_fd())?;
        self.created(&mut st, path, ino)?;
        Ok(f)
    }

    fn write_synced(&self, path: &Path, bytes: &[u8], site: SyncSite) -> io::Result<()> {
        let mut st = self.op()?;
        let ino = if path.exists() {
            let ino = self.bury(path)?;
            self.before_write(&mut st, ino)?;
            ino
        } else {
            let f = OpenOptions::new().write(true).create_new(true).open(path)?;
            let ino = ino_of_fd(f.as_raw_fd())?;
            self.created(&mut st, path, ino)?;
            ino
        };
        let mut f = OpenOptions::new().write(true).truncate(true).open(path)?;
        f.write_all(bytes)?;
        Shared::synced(&mut st, ino, site);
        Ok(())
    }

    fn sync_dir(&self, dir: &Path, site: SyncSite) -> io::Result<()> {
        let mut st = self.op()?;
        st.note(format_args!("sync_dir {} {site:?}", dir.display()));
        if st.skip != Some(site) {
            st.changes.retain(|c| c.dir != dir);
        }
        Ok(())
    }

    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        let mut st = self.op()?;
        if std::fs::symlink_metadata(from)?.is_dir() {
            return std::fs::rename(from, to);
        }
        let ino = self.bury(from)?;
        let replaced = match std::fs::symlink_metadata(to) {
            Ok(_) => Some(self.bury(to)?),
            Err(_) => None,
        };
        std::fs::rename(from, to)?;
        self.renamed(&mut st, from, to, replaced, ino);
        Ok(())
    }

    fn rename_noreplace(&self, from: &Path, to: &Path) -> io::Result<()> {
        let mut st = self.op()?;
        let ino = self.bury(from)?;
        super::fsops::rename_noreplace(from, to)?;
        self.renamed(&mut st, from, to, None, ino);
        Ok(())
    }

    fn open_existing(&self, path: &Path, custom_flags: i32) -> io::Result<File> {
        let mut st = self.op()?;
        let ino = self.bury(path)?;
        st.note(format_args!("open {} i{ino}", path.display()));
        // Whatever is written through it is unsynced until a sync says
        // otherwise (the block engine's writes, the header zeroing).
        self.before_write(&mut st, ino)?;
        OpenOptions::new()
            .write(true)
            .custom_flags(custom_flags)
            .open(path)
    }

    fn retire(&self, from: &Path, to: &Path) -> io::Result<()> {
        let mut st = self.op()?;
        let ino = self.bury(from)?;
        super::fsops::rename_noreplace(from, to)?;
        self.renamed(&mut st, from, to, None, ino);
        // For the block, a removal (excuses its absence after a crash).
        let n = st.ops;
        st.removed_blocks.push((n, from.to_path_buf()));
        Ok(())
    }

    fn remove_file(&self, path: &Path, why: Unlink) -> io::Result<()> {
        let mut st = self.op()?;
        let ino = self.bury(path)?;
        std::fs::remove_file(path)?;
        st.note(format_args!("unlink {} i{ino} {why:?}", path.display()));
        st.changes.push(Change {
            dir: parent(path),
            path: path.to_path_buf(),
            old: Some(Node::File(ino)),
        });
        if why == Unlink::Block {
            let n = st.ops;
            st.removed_blocks.push((n, path.to_path_buf()));
        }
        Ok(())
    }

    fn create_dir(&self, path: &Path) -> io::Result<()> {
        let mut st = self.op()?;
        std::fs::create_dir(path)?;
        st.note(format_args!("mkdir {}", path.display()));
        st.changes.push(Change {
            dir: parent(path),
            path: path.to_path_buf(),
            old: None,
        });
        Ok(())
    }

    fn create_dir_all(&self, path: &Path) -> io::Result<()> {
        let missing: Vec<&Path> = path.ancestors().take_while(|p| !p.exists()).collect();
        for p in missing.into_iter().rev() {
            self.create_dir(p)?;
        }
        Ok(())
    }

    fn remove_dir_all(&self, path: &Path) -> io::Result<()> {
        let mut st = self.op()?;
        st.note(format_args!("rm -r {}", path.display()));
        std::fs::remove_dir_all(path)?;
        st.changes.retain(|c| !c.dir.starts_with(path));
        Ok(())
    }

    /// Only ever an empty directory whose creation was made durable first
    /// (remove.rs), then the parent's fsync: nothing for a cut to undo
    /// but an empty directory coming back. Durable at once in this model,
    /// and so are the removals of the entries it held (it could only go
    /// once empty): a delete's unlink that lands between the reclaimer's
    /// fsync of the directory and its removal is not taken back into a
    /// directory that no longer exists.
    fn remove_dir(&self, path: &Path) -> io::Result<()> {
        let mut st = self.op()?;
        st.note(format_args!("rmdir {}", path.display()));
        std::fs::remove_dir(path)?;
        st.changes.retain(|c| c.dir != path);
        Ok(())
    }

    fn owner_lock(&self) -> bool {
        false
    }

    fn open_slab(&self, path: &Path, direct: bool) -> io::Result<File> {
        let _st = self.op()?;
        self.bury(path)?;
        super::slots::open_slab(path, direct)
    }

    fn sync_slab(&self, file: &File, site: SyncSite) -> io::Result<()> {
        let mut st = self.op()?;
        let ino = ino_of_fd(file.as_raw_fd())?;
        Shared::synced(&mut st, ino, site);
        Ok(())
    }

    /// A punch is a write of zeros (lost at a power cut unless synced).
    fn punch(&self, file: &File, off: u64, len: u64) -> io::Result<()> {
        let mut st = self.op()?;
        let ino = ino_of_fd(file.as_raw_fd())?;
        self.before_write(&mut st, ino)?;
        super::fsops::punch_hole(file, off, len)
    }

    fn slot_released(&self, path: &Path) {
        let mut st = self.lock();
        st.note(format_args!("slot released {}", path.display()));
        let n = st.ops;
        st.removed_blocks.push((n, path.to_path_buf()));
    }

    /// The model's syncfs is exact (`PowerLossEngine::sync_fs`), whatever
    /// the real filesystem under the test is.
    fn syncfs_durable(&self, _dir: &Path, _direct: bool) -> bool {
        true
    }

    fn index_backend(&self, path: &Path) -> io::Result<Option<super::seam::IndexBackend>> {
        let mut st = self.op()?;
        let exists = path.exists();
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)?;
        let ino = ino_of_fd(file.as_raw_fd())?;
        if exists {
            self.bury(path)?;
        } else {
            self.created(&mut st, path, ino)?;
        }
        drop(st);
        Ok(Some(super::seam::IndexBackend(Box::new(IndexFile {
            fs: Arc::clone(&self.shared),
            file,
            ino,
        }))))
    }
}

/// `index.redb` through the simulator (redb's `StorageBackend`): writes
/// and `set_len` are unsynced data of the file's inode, `sync_data` makes
/// them durable.
pub struct IndexFile {
    fs: Arc<Shared>,
    file: File,
    ino: u64,
}

impl std::fmt::Debug for IndexFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IndexFile").field("ino", &self.ino).finish()
    }
}

impl redb::StorageBackend for IndexFile {
    fn len(&self) -> io::Result<u64> {
        Ok(self.file.metadata()?.len())
    }

    fn read(&self, offset: u64, out: &mut [u8]) -> io::Result<()> {
        self.file.read_exact_at(out, offset)
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        let mut st = self.fs.op()?;
        self.fs.before_write(&mut st, self.ino)?;
        self.file.set_len(len)
    }

    fn sync_data(&self) -> io::Result<()> {
        let mut st = self.fs.op()?;
        Shared::synced(&mut st, self.ino, SyncSite::IndexSync);
        Ok(())
    }

    fn write(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        let mut st = self.fs.op()?;
        self.fs.before_write(&mut st, self.ino)?;
        self.file.write_all_at(data, offset)
    }
}

/// The block-data engine through the simulator.
struct PowerLossEngine {
    fs: Arc<PowerLossFs>,
    inner: Arc<dyn IoEngine>,
}

impl IoEngine for PowerLossEngine {
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
        let mut st = self.fs.op()?;
        let ino = ino_of_fd(fd)?;
        st.note(format_args!("write i{ino} at {at} len {len}"));
        self.fs.before_write(&mut st, ino)?;
        // SAFETY: F_GETFL reads the fd's flags.
        let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
        st.block_data.insert(ino);
        self.inner.write_file(fd, at, len, bufs, fill)?;
        if flags >= 0 && flags & libc::O_DSYNC == libc::O_DSYNC {
            Shared::synced(&mut st, ino, SyncSite::BlockODsync);
        }
        Ok(())
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
        let mut st = self.fs.op()?;
        let ino = ino_of_fd(fd)?;
        Shared::synced(&mut st, ino, SyncSite::BlockFdatasync);
        Ok(())
    }

    /// syncfs: the data of every block file this engine wrote so far is
    /// durable (the engine's writes run under the state lock, so "so far"
    /// is exact: a write still in flight in another thread has not begun).
    /// Only block data is credited, although Linux's syncfs also writes
    /// back the index file and commits directory entries: G3 must not rely
    /// on that, so the model is the weaker promise and the index sync and
    /// directory fsyncs stay load-bearing.
    fn sync_fs(&self, _fd: RawFd) -> io::Result<()> {
        let mut st = self.fs.op()?;
        st.note(format_args!("syncfs"));
        if st.skip != Some(SyncSite::BlockGroupSyncfs) {
            let inos: Vec<u64> = st.block_data.drain().collect();
            for ino in inos {
                st.dirty.remove(&ino);
            }
        }
        Ok(())
    }
}
